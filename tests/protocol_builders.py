"""Builders shared by the dialect tests: dialects with fixed id sources, contexts, bodies.

``make_dialect(cls, **options)`` builds a dialect from settings with those options;
``begin(dialect, ctx, ids)`` starts a request's state from ``ids`` (fixed clock, fixed transfer
id, a small room range). ``nixl_prefill_skeleton()`` is the one copy, for every suite, of the
``kv_transfer_params`` a vLLM NixlConnector prefill leg carries (docs/driving/handoffs.md): the
golden
tests compare against it, the stub and real-engine tests send it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sidecar.config.settings import Settings
from sidecar.dialects import Dialect, DialectSetup, handoff_keys
from sidecar.dialects.base import EngineLookup
from sidecar.dialects.sglang import INT32_ROOMS, RoomAllocator, SGLangDialect
from sidecar.dialects.trtllm import SnowflakeIds, TRTLLMDialect
from sidecar.dialects.vllm_mooncake import MooncakeDialect
from sidecar.protocol.context import FrontDoor, HandoffContext, PrefillTarget, Route
from sidecar.protocol.request import BodyChecks

D = TypeVar("D", bound=Dialect)

#: The client-body checks of a sidecar with every registered dialect (as the runtime builds).
BODY_CHECKS = BodyChecks(handoff_keys())
HANDOFF_FIELDS = BODY_CHECKS.handoff_fields
#: The two OpenAI routes, in a fixed order (tests parametrized over them).
OPENAI_ROUTE_LIST = [Route.COMPLETIONS, Route.CHAT]
parse_client_body = BODY_CHECKS.parse

#: 2026-01-01T00:00:00Z: the instant of the vectors in docs/driving/handoffs.md#trtllm-snowflake.
FIXED_NOW_MS = 1_767_225_600_000


def make_ctx(
    route: Route = Route.COMPLETIONS,
    *,
    host: str = "10.0.0.7",
    port: int = 8200,
    advertise_host: str | None = None,
    state: Any = None,
    front_door: FrontDoor = FrontDoor.HTTP,
    prefill_rank: int | None = None,
    decode_rank: int | None = None,
) -> HandoffContext:
    return HandoffContext(
        route=route,
        request_id="req-1",
        prefill=PrefillTarget(host=host, port=port),
        advertise_host=advertise_host or host,
        front_door=front_door,
        state=state,
        prefill_rank=prefill_rank,
        decode_rank=decode_rank,
    )


def make_dialect(cls: type[D], *, lookup: EngineLookup | None = None, lane: int = 0,
                 lanes: int = 1, local_ranks: int = 1, prefill_ranks: int = 1,
                 **options: Any) -> D:
    """A dialect built from settings carrying ``options`` (e.g. sglang_bootstrap_port), for
    engines of ``local_ranks`` and ``prefill_ranks`` data-parallel ranks."""
    settings = Settings.model_validate(options)
    return cls(DialectSetup(settings, lane=lane, lanes=lanes, lookup=lookup,
                            local_ranks=local_ranks, prefill_ranks=prefill_ranks))


@dataclass
class Ids:
    """Fixed id sources for a dialect under test (``begin`` installs them)."""

    snowflake: SnowflakeIds
    rooms: RoomAllocator
    transfer_id: Callable[[], str] = field(default=lambda: "xfer-fixed")


def make_ids(*, machine_id: int = 0, max_room: int = INT32_ROOMS) -> Ids:
    return Ids(
        snowflake=SnowflakeIds(machine_id, clock_ms=lambda: FIXED_NOW_MS),
        rooms=RoomAllocator(max_room),
    )


def install(dialect: Dialect, ids: Ids) -> None:
    """Give ``dialect`` the fixed id sources of ``ids`` (the ones its kind uses)."""
    if isinstance(dialect, TRTLLMDialect):
        dialect.ids = ids.snowflake
    elif isinstance(dialect, SGLangDialect):
        dialect.rooms = dialect.grpc_rooms = ids.rooms
    elif isinstance(dialect, MooncakeDialect):
        dialect.new_transfer_id = ids.transfer_id


def begin(dialect: Dialect, ctx: HandoffContext, ids: Ids | None = None) -> HandoffContext:
    """``dialect.begin(ctx)`` drawing from ``ids`` (fixed ones by default)."""
    install(dialect, ids if ids is not None else make_ids())
    return dialect.begin(ctx)


def completions_body(**extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "m",
        "prompt": "hello world",
        "max_tokens": 64,
        "min_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    body.update(extra)
    return body


def chat_body(**extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 64,
        "min_completion_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    }
    body.update(extra)
    return body


def nixl_prefill_skeleton() -> dict[str, Any]:
    """The NIXL (``shfs``) prefill leg's ``kv_transfer_params``: exactly these six keys."""
    return {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
