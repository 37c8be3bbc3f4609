"""vLLM MooncakeConnector (pod label ``mooncake``): push model, prefill and decode at once.

docs/driving/handoffs.md#vllm-mooncake, confirmed against vLLM's
``MooncakeConnectorMetadata.add_new_req``
(what the decode reads) and its Mooncake proxy example:

    begin:   transfer id T := "xfer-<uuid>"
    look_up: engine id E := GET <remote_bootstrap_addr>/query, the entry of the prefill's
             data-parallel rank (rank 0 without one; cached per host and rank a minute)
    prefill kv_transfer_params = {do_remote_decode: true, do_remote_prefill: false,
                                  transfer_id: T}
    decode kv_transfer_params  = {do_remote_decode: false, do_remote_prefill: true,
                                  transfer_id: T,
                                  remote_bootstrap_addr: "http://<advertise host>:<port>",
                                  remote_engine_id: E}

``E`` comes from the prefill's bootstrap server, ``GET <remote_bootstrap_addr>/query``,
fetched through the core's ``EngineLookup`` and cached here (``EngineIdCache``, on
``sidecar.ttl_cache``: one ``/query`` in flight per host and rank however many requests wait
for it; ids change when an engine restarts, so entries expire after a minute and are
evicted). ``engine_id_from_query`` reads
both answer shapes vLLM has shipped:

    {"<dp_rank>": {"engine_id": E, "worker_addr": {...}, ...}, ...}     (dict[int, EngineEntry])
    {"<E>": {"<dp_rank>": {"<tp_rank>": {"<pp_rank>": addr}}}, ...}    (dict[EngineId, ...])

Routes: as NIXL's (``vllm_nixl``): every route takes ``kv_transfer_params`` at the top level
(recorded on Responses, Messages and generate, vLLM 0.32).

Data-parallel prefill engines (one API server, one bootstrap server for every rank; vLLM
0.32.0's recorded answer ``{"0": {"engine_id": "<id>_dp0", ...}, "1": {"engine_id":
"<id>_dp1", ...}}``): the prefill leg goes to rank r by the vLLM header, and the decode names
``/query``'s entry r (read, never built: hybrid load balancing keys local ranks, ids global).
The decode's own rank is its header. Both legs run at once, so the rank is chosen before
either is sent.

Deliberate limits: the prefill response carries no params and is not read; no invalidation
of a cached engine id on a failed decode (a decode fails for many reasons; the id is stale
only after a restart, which the expiry covers).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import msgspec
from pydantic import Field

from sidecar import jsonutil
from sidecar.dialects.base import (
    DialectOptions,
    DialectSetup,
    EngineLookup,
    Legs,
    LookupFailed,
)
from sidecar.dialects.vllm import KV_TRANSFER_PARAMS, VLLMDialect
from sidecar.errors import InvalidHandoff, SidecarError, Stage
from sidecar.protocol.context import HandoffContext, Route, http_url
from sidecar.protocol.request import new_request_id
from sidecar.ttl_cache import SingleFlightTTLCache

ENGINE_ID: Final = "engine_id"
QUERY_PATH: Final = "/query"
#: A bootstrap /query answer is a small JSON object.
_MAX_QUERY_BYTES: Final = 1024 * 1024
#: How long a looked-up engine id is trusted (an engine that restarts gets a new one).
ENGINE_ID_TTL_S: Final = 60.0


def _is_rank_key(key: object) -> bool:
    """True for a JSON object key that names a rank (an int, or its decimal text)."""
    if isinstance(key, bool):
        return False
    if isinstance(key, int):
        return key >= 0
    return isinstance(key, str) and key.isascii() and key.isdigit()


def _has_rank(entry: Mapping[Any, Any], rank: int) -> bool:
    return str(rank) in entry or rank in entry


def engine_id_from_query(payload: object, dp_rank: int = 0) -> str:
    """The prefill engine id for ``dp_rank`` from a bootstrap ``/query`` answer; raises
    ``InvalidHandoff`` for any other shape, a missing rank, or several engines serving it."""
    if not isinstance(payload, Mapping) or not payload:
        raise InvalidHandoff("Mooncake /query answer is not a non-empty object")
    entries = list(payload.items())
    if all(isinstance(value, Mapping) and ENGINE_ID in value for _, value in entries):
        # Shape 1: keyed by data-parallel rank.
        entry = payload.get(str(dp_rank), payload.get(dp_rank))
        if entry is None:
            ranks = ", ".join(sorted(str(key) for key in payload))
            raise InvalidHandoff(
                f"Mooncake /query answer has no data-parallel rank {dp_rank} (ranks: {ranks})"
            )
        engine_id = entry[ENGINE_ID]
        if not isinstance(engine_id, str) or not engine_id:
            raise InvalidHandoff("Mooncake /query answer has an engine_id that is not a string")
        return engine_id
    if all(
        isinstance(key, str)
        and key
        and isinstance(value, Mapping)
        and all(_is_rank_key(rank) for rank in value)
        for key, value in entries
    ):
        # Shape 2: keyed by engine id, then data-parallel rank.
        matches = [key for key, value in entries if _has_rank(value, dp_rank)]
        if len(matches) == 1:
            return str(matches[0])
        if not matches:
            raise InvalidHandoff(
                f"Mooncake /query answer has no engine serving data-parallel rank {dp_rank}"
            )
        raise InvalidHandoff(
            f"Mooncake /query answer has {len(matches)} engines serving data-parallel rank "
            f"{dp_rank}; cannot tell which one holds the KV"
        )
    raise InvalidHandoff("Mooncake /query answer has an unknown shape")


class MooncakeOptions(DialectOptions):
    """The Mooncake connector's settings."""

    mooncake_bootstrap_port: int = Field(
        default=8998, ge=1, le=65535, description="vLLM Mooncake connector's bootstrap port."
    )


class MooncakeState(msgspec.Struct, frozen=True):
    """One request's transfer id, and (once looked up) its prefill engine's id."""

    transfer_id: str
    engine_id: str | None = None


def new_transfer_id() -> str:
    """A ``transfer_id``: one per request, chosen by the router."""
    return f"xfer-{new_request_id()}"


class EngineIdCache:
    """``(host:port, rank) -> engine id`` for ``ttl_s`` seconds, asked through an
    ``EngineLookup``, one ``/query`` at a time per key."""

    def __init__(self, lookup: EngineLookup, *, ttl_s: float = ENGINE_ID_TTL_S,
                 port_hint: str = "") -> None:
        self._lookup = lookup
        self._ids: SingleFlightTTLCache[tuple[str, int], str] = SingleFlightTTLCache(ttl_s)
        #: What set the port asked (said when the bootstrap server cannot be reached).
        self._port_hint = port_hint

    async def get(self, bootstrap_addr: str, dp_rank: int = 0) -> str:
        return await self._ids.get((bootstrap_addr, dp_rank),
                                   lambda: self._query(bootstrap_addr + QUERY_PATH, dp_rank))

    async def close(self) -> None:
        await self._ids.close()

    async def _query(self, url: str, dp_rank: int) -> str:
        try:
            status, raw = await self._lookup.get(url, max_bytes=_MAX_QUERY_BYTES)
        except LookupFailed:
            raise InvalidHandoff(
                f"prefill bootstrap /query unreachable at {url}{self._port_hint}",
                stage=Stage.PREFILL, address=url,
            ) from None
        if status != 200:
            raise InvalidHandoff(
                f"prefill bootstrap /query at {url} answered HTTP {status}{self._port_hint}",
                stage=Stage.PREFILL, address=url,
            )
        try:
            payload = jsonutil.loads(raw)
        except jsonutil.JSONDecodeError:
            raise InvalidHandoff("prefill bootstrap /query answered malformed JSON") from None
        return engine_id_from_query(payload, dp_rank)


class MooncakeDialect(VLLMDialect):
    """Concurrent legs paired by a router-chosen ``transfer_id``."""

    connector = "mooncake"
    aliases = ("MooncakeConnector",)
    legs = Legs.CONCURRENT
    pd_routes = frozenset(Route)
    looks_up = True
    checked_against = (
        "vLLM main (2026 snapshot) MooncakeConnector (transfer_id, remote_bootstrap_addr, "
        "remote_engine_id) and its bootstrap /query, both answer shapes"
    )

    Options = MooncakeOptions

    def __init__(self, setup: DialectSetup) -> None:
        super().__init__(setup)
        self.bootstrap_port = MooncakeOptions.of(setup.settings).mooncake_bootstrap_port
        hint = (f": check that the prefill engine's VLLM_MOONCAKE_BOOTSTRAP_PORT is "
                f"{self.bootstrap_port}, the port this sidecar asks (--mooncake-bootstrap-port "
                "or DISAGG_MOONCAKE_BOOTSTRAP_PORT), and that vLLM's bootstrap server runs "
                "there (MooncakeConnector, kv_role kv_producer or kv_both)")
        self.engine_ids = (None if setup.lookup is None
                           else EngineIdCache(setup.lookup, port_hint=hint))
        self.new_transfer_id = new_transfer_id

    def begin(self, ctx: HandoffContext) -> HandoffContext:
        return ctx.with_state(MooncakeState(self.new_transfer_id()))

    async def close(self) -> None:
        if self.engine_ids is not None:
            await self.engine_ids.close()

    async def look_up(self, ctx: HandoffContext) -> HandoffContext:
        state = _state(ctx)
        if self.engine_ids is None:
            raise SidecarError("the Mooncake dialect was built without an engine lookup")
        engine_id = await self.engine_ids.get(self._bootstrap_addr(ctx), ctx.prefill_rank or 0)
        return ctx.with_state(MooncakeState(state.transfer_id, engine_id))

    def _bootstrap_addr(self, ctx: HandoffContext) -> str:
        # vLLM's decode appends "/query" to it, so the scheme is required.
        return http_url(ctx.advertise_host, self.bootstrap_port)

    def prefill_fields(self, ctx: HandoffContext) -> dict[str, Any]:
        return {
            KV_TRANSFER_PARAMS: {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "transfer_id": _state(ctx).transfer_id,
            }
        }

    def handoff(
        self, prefill_response: Mapping[str, Any] | None, ctx: HandoffContext
    ) -> dict[str, Any]:
        state = _state(ctx)
        if not state.engine_id:
            raise InvalidHandoff(
                "Mooncake decode needs the prefill engine id (bootstrap /query gave none)"
            )
        return {
            KV_TRANSFER_PARAMS: {
                "do_remote_decode": False,
                "do_remote_prefill": True,
                "transfer_id": state.transfer_id,
                "remote_bootstrap_addr": self._bootstrap_addr(ctx),
                "remote_engine_id": state.engine_id,
            }
        }


def _state(ctx: HandoffContext) -> MooncakeState:
    if not isinstance(ctx.state, MooncakeState):
        raise SidecarError("Mooncake request has no transfer id (begin not called)")
    return ctx.state
