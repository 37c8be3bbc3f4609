"""vLLM NixlPushConnector (pod label ``nixl-push``): the decode registers while the prefill runs.

docs/driving/nixl-push.md (the keys, with vLLM 0.32's file and line for each):

    look_up:  identity I of (prefill target, its data-parallel rank) := the cache's entry, the
              operator's (--nixl-push-engine-id), or none yet; none: this request learns it
              (one request per key at a time; the others wait for its answer)
    prefill kv_transfer_params = {do_remote_decode: true, do_remote_prefill: false}
    legs:     I known: both at once (prefill watched); else prefill, then decode
    decode kv_transfer_params  = {do_remote_prefill: true, do_remote_decode: false,
                                  remote_engine_id: I.engine_id, remote_host: advertise host,
                                  remote_port: I.port, tp_size, pp_size, dcp_size,
                                  remote_request_id: the prefill's (its answer's, else the
                                  request id: vLLM pairs the legs by X-Request-Id)}
    an answer (either way) whose identity differs from the cache's replaces it; a decode that
    failed on an identity the prefill's answer disproves is sent again with the answer's
    (the flow: ``answered_stale``); a prefill target that refused the connection is forgotten

The identity is the prefill engine's NIXL side channel: its ``engine_id`` (random per start
unless configured), the side-channel port (``VLLM_NIXL_SIDE_CHANNEL_PORT`` + rank), its
tensor-, pipeline- and decode-context-parallel sizes. The host is the prefill target's own
(as for pull: vLLM's default ``VLLM_NIXL_SIDE_CHANNEL_HOST`` is localhost). It is learned from
prefill answers only: the side channel is never probed (a request for a rank it does not
have kills its listener thread).

Data-parallel prefill engines (vLLM 0.32 ``EngineCore``: ``engine_id`` becomes
``<id>_dp<rank>``; ``NixlBaseConnectorScheduler``: port + ``data_parallel_index``): one
identity per rank, learned from that rank's answers; an operator-given one is made per rank
the same way.

Deliberate limits: a refused decode is sent again only where the flow sees the refusal before
the client saw a byte (a 5xx head; a completions or chat stream whose first event is an
error); the gRPC door's Decode cannot resend (the prefill's answer is on the other sidecar).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Final

import msgspec
from pydantic import Field

from sidecar import jsonutil
from sidecar.bounded import BoundedMap
from sidecar.dialects.base import DialectOptions, DialectSetup, Legs, PodSource
from sidecar.dialects.vllm import KV_TRANSFER_PARAMS, VLLMDialect
from sidecar.errors import InvalidHandoff, PrefillUnreachable, SidecarError
from sidecar.protocol.context import FrontDoor, HandoffContext, PrefillTarget, Route

REMOTE_ENGINE_ID: Final = "remote_engine_id"
REMOTE_HOST: Final = "remote_host"
REMOTE_PORT: Final = "remote_port"
REMOTE_REQUEST_ID: Final = "remote_request_id"
TP_SIZE: Final = "tp_size"
PP_SIZE: Final = "pp_size"
DCP_SIZE: Final = "dcp_size"
TRANSFER_MODE: Final = "transfer_mode"
PUSH: Final = "push"
#: vLLM's default VLLM_NIXL_SIDE_CHANNEL_PORT.
DEFAULT_SIDE_CHANNEL_PORT: Final = 5600
#: What vLLM 0.32 answers for a request its engine finished with an error (a KV load that
#: failed, under ``kv_load_failure_policy: fail``, the default: a handshake refused on an
#: engine-id mismatch among its causes): ``GenerationError("Internal server error")``,
#: ``vllm/entrypoints/generate/base/serving.py`` (``_raise_if_error``); HTTP 500 for a JSON
#: answer, the first event of a stream.
KV_LOAD_FAILED: Final = "Internal server error"

#: (prefill target, data-parallel rank): whose identity an entry is.
IdentityKey = tuple[PrefillTarget, int]


@dataclass(frozen=True, slots=True)
class PrefillIdentity:
    """What a push decode must know of its prefill engine (the host is the target's)."""

    engine_id: str
    port: int
    tp_size: int = 1
    pp_size: int = 1
    dcp_size: int = 1


def _positive_int(params: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = params.get(key, default)
    if value is None:
        raise InvalidHandoff(f"prefill response kv_transfer_params lacks {key}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidHandoff(
            f"prefill response kv_transfer_params {key} is not a positive integer"
        )
    return value


def identity_from_answer(prefill_response: Mapping[str, Any] | None) -> PrefillIdentity:
    """The prefill engine's identity from its answer's ``kv_transfer_params``; raises
    ``InvalidHandoff`` when they are missing, malformed, or not a push engine's."""
    if prefill_response is None:
        raise InvalidHandoff("NIXL push hand-off needs the prefill engine's identity")
    params = prefill_response.get(KV_TRANSFER_PARAMS)
    if params is None:
        # vLLM omits them when the prefill did not end at the length cap (e.g. aborted).
        raise InvalidHandoff("prefill response has no kv_transfer_params")
    if not isinstance(params, Mapping):
        raise InvalidHandoff(
            f"prefill response kv_transfer_params is a {jsonutil.type_name(params)}, "
            "expected an object"
        )
    mode = params.get(TRANSFER_MODE, PUSH)
    if mode != PUSH:
        raise InvalidHandoff(
            f"prefill engine answered transfer_mode {mode!r}: it runs NIXL in another mode "
            "than push (NixlConnector is --kv-connector shfs)"
        )
    engine_id = params.get(REMOTE_ENGINE_ID)
    if not isinstance(engine_id, str) or not engine_id:
        raise InvalidHandoff("prefill response kv_transfer_params lacks remote_engine_id")
    port = _positive_int(params, REMOTE_PORT)
    if port > 65535:
        raise InvalidHandoff("prefill response kv_transfer_params remote_port is not a port")
    return PrefillIdentity(
        engine_id=engine_id,
        port=port,
        tp_size=_positive_int(params, TP_SIZE),
        pp_size=_positive_int(params, PP_SIZE, 1),
        dcp_size=_positive_int(params, DCP_SIZE, 1),
    )


class NixlPushOptions(DialectOptions):
    """The NIXL push connector's settings."""

    nixl_push_engine_id: str | None = Field(
        default=None,
        min_length=1,
        description="NIXL push: the prefill engine's engine_id (its --kv-transfer-config "
        "engine_id), when known up front: the first request to a target runs both legs at "
        "once. For one prefill engine (a data-parallel one: <id>_dp<rank>, port + rank); "
        "gRPC Prefill uses it for its own engine. Unset: learned from each target's first "
        "answer.",
    )
    nixl_push_side_channel_port: int = Field(
        default=DEFAULT_SIDE_CHANNEL_PORT, ge=1, le=65535,
        description="NIXL push: the prefill engine's VLLM_NIXL_SIDE_CHANNEL_PORT (with "
        "--nixl-push-engine-id).",
    )
    nixl_push_tp_size: int = Field(
        default=1, ge=1,
        description="NIXL push: the prefill engine's tensor-parallel size (with "
        "--nixl-push-engine-id).",
    )
    nixl_push_pp_size: int = Field(
        default=1, ge=1,
        description="NIXL push: the prefill engine's pipeline-parallel size (with "
        "--nixl-push-engine-id).",
    )
    nixl_push_identities: int = Field(
        default=1024, ge=1,
        description="NIXL push: prefill identities kept (one per prefill target and "
        "data-parallel rank); the oldest learned is forgotten first.",
    )
    nixl_push_engine_id_annotation: str = Field(
        default="model.aibrix.ai/nixl-push-engine-id",
        min_length=1,
        description="Annotation holding the NIXL push prefill engine_id.",
    )

    pod_sources = MappingProxyType({
        "nixl_push_engine_id": PodSource("annotation", "nixl_push_engine_id_annotation"),
    })


class IdentityCache:
    """Learned prefill identities by (target, rank), at most ``size`` (a ``BoundedMap``: the
    oldest learned out first; a read is no use), with the keys being learned right now (one
    learner per key: single flight; a key leaves when its learner ends, so these are as many
    as the requests in flight)."""

    def __init__(self, size: int) -> None:
        self._entries: BoundedMap[IdentityKey, PrefillIdentity] = BoundedMap(size)
        self._learning: dict[IdentityKey, asyncio.Future[None]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: IdentityKey) -> PrefillIdentity | None:
        return self._entries.peek(key)

    def put(self, key: IdentityKey, identity: PrefillIdentity) -> None:
        """Keep ``identity`` for ``key`` (replacing an older one), and wake its waiters."""
        if self._entries.peek(key) != identity:
            self._entries[key] = identity  # the newest learned; past the bound the oldest goes
        self.finish_learning(key)

    def drop(self, key: IdentityKey, identity: PrefillIdentity | None) -> None:
        """Forget ``key``'s entry if it still is ``identity`` (a newer one stays)."""
        if identity is not None and self._entries.peek(key) == identity:
            del self._entries[key]

    def start_learning(self, key: IdentityKey) -> asyncio.Future[None] | None:
        """None when the caller now learns ``key``; else the learner's future to wait on."""
        pending = self._learning.get(key)
        if pending is not None and not pending.done():
            return pending
        self._learning[key] = asyncio.get_running_loop().create_future()
        return None

    def finish_learning(self, key: IdentityKey) -> None:
        """The learner of ``key`` is done (learned or not): its waiters look again."""
        pending = self._learning.pop(key, None)
        if pending is not None and not pending.done():
            pending.set_result(None)


class PushState(msgspec.Struct, frozen=True):
    """One request's prefill identity: the one its decode is sent with (None: learns it)."""

    key: IdentityKey
    identity: PrefillIdentity | None
    #: True while this request is its key's learner (the others wait for it).
    learner: bool = False


class NixlPushDialect(VLLMDialect):
    """Both legs at once once the prefill target's identity is known; one after the other
    for the request that learns it."""

    connector = "nixl-push"
    aliases: ClassVar[tuple[str, ...]] = ("NixlPushConnector",)
    legs = Legs.CONCURRENT
    looks_up = True
    learns = True
    pd_routes = frozenset(Route)
    checked_against = (
        "vLLM 0.32.0 NixlPushConnector (push_scheduler.py, metadata.py, base_scheduler.py) "
        "and its push proxy example"
    )

    Options = NixlPushOptions

    def __init__(self, setup: DialectSetup) -> None:
        super().__init__(setup)
        options = NixlPushOptions.of(setup.settings)
        self.identities = IdentityCache(options.nixl_push_identities)
        self._given = None if options.nixl_push_engine_id is None else PrefillIdentity(
            engine_id=options.nixl_push_engine_id,
            port=options.nixl_push_side_channel_port,
            tp_size=options.nixl_push_tp_size,
            pp_size=options.nixl_push_pp_size,
        )

    # -- the identity ---------------------------------------------------------------------

    def _key(self, ctx: HandoffContext) -> IdentityKey:
        return ctx.prefill, ctx.prefill_rank or 0

    def _given_for(self, ctx: HandoffContext) -> PrefillIdentity | None:
        """The operator's identity for the leg's rank (vLLM suffixes ids and ports by rank)."""
        given = self._given
        ranks = (self.setup.local_ranks if ctx.front_door is FrontDoor.GRPC
                 else self.setup.prefill_ranks)
        if given is None or ranks <= 1:
            return given
        rank = ctx.prefill_rank or 0
        return PrefillIdentity(f"{given.engine_id}_dp{rank}", given.port + rank,
                               given.tp_size, given.pp_size, given.dcp_size)

    async def look_up(self, ctx: HandoffContext) -> HandoffContext:
        key = self._key(ctx)
        cache = self.identities
        while True:
            identity = cache.get(key) or self._given_for(ctx)
            if identity is not None:
                return ctx.with_state(PushState(key, identity))
            pending = cache.start_learning(key)
            if pending is None:
                return ctx.with_state(PushState(key, None, learner=True))
            # Another request is learning this target: its answer comes sooner than ours
            # would (asyncio.wait: a cancelled waiter leaves the learner's future alone).
            await asyncio.wait((pending,))

    def legs_for(self, ctx: HandoffContext) -> Legs:
        return Legs.SEQUENTIAL if _state(ctx).identity is None else Legs.CONCURRENT

    def end(self, ctx: HandoffContext) -> None:
        state = ctx.state
        if isinstance(state, PushState) and state.learner:
            self.identities.finish_learning(state.key)

    def answered_stale(self, prefill_response: Mapping[str, Any], ctx: HandoffContext) -> bool:
        state = _state(ctx)
        try:
            identity = identity_from_answer(prefill_response)
        except SidecarError:
            return False
        self.identities.put(state.key, identity)
        return identity != state.identity

    def refusal_may_be_stale(self, refused: SidecarError, ctx: HandoffContext) -> bool:
        # Only the engine's own "the request failed" (a KV load that failed) can be a stale
        # identity; a decode engine that is down, overloaded or failing otherwise ends the
        # pair at once instead of waiting for the prefill's answer.
        return refused.engine_reason == KV_LOAD_FAILED

    def leg_failed(self, error: Exception, ctx: HandoffContext) -> None:
        # A target that refuses connections is restarting, likely under a new engine id.
        if isinstance(error, PrefillUnreachable) and ctx.state is not None:
            state = _state(ctx)
            self.identities.drop(state.key, state.identity)

    # -- bodies ---------------------------------------------------------------------------

    def prefill_fields(self, ctx: HandoffContext) -> dict[str, Any]:
        return {KV_TRANSFER_PARAMS: {"do_remote_decode": True, "do_remote_prefill": False}}

    def handoff(
        self, prefill_response: Mapping[str, Any] | None, ctx: HandoffContext
    ) -> dict[str, Any]:
        state = _state(ctx)
        request_id = ctx.request_id
        if prefill_response is None:
            identity = state.identity
            if identity is None:
                raise InvalidHandoff("NIXL push hand-off needs the prefill engine's identity")
        else:
            identity = identity_from_answer(prefill_response)
            self.identities.put(state.key, identity)
            params = prefill_response[KV_TRANSFER_PARAMS]
            answered_id = params.get(REMOTE_REQUEST_ID)
            if isinstance(answered_id, str) and answered_id:
                request_id = answered_id
        return {
            KV_TRANSFER_PARAMS: {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                REMOTE_ENGINE_ID: identity.engine_id,
                REMOTE_HOST: ctx.advertise_host,
                REMOTE_PORT: identity.port,
                TP_SIZE: identity.tp_size,
                PP_SIZE: identity.pp_size,
                DCP_SIZE: identity.dcp_size,
                REMOTE_REQUEST_ID: request_id,
            }
        }


def _state(ctx: HandoffContext) -> PushState:
    if not isinstance(ctx.state, PushState):
        raise SidecarError("NIXL push request has no prefill identity (look_up not called)")
    return ctx.state
