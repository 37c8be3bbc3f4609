"""Builders shared by the engine-handler and KV-agent tests: contexts, fixed id sources, bodies.

``nixl_prefill_skeleton()`` is the one copy, for every suite, of the ``kv_transfer_params`` a
vLLM NixlConnector prefill leg carries (contracts.md): the golden tests compare against it,
the stub and real-engine tests send it.
"""

from __future__ import annotations

from typing import Any

from sidecar.ids import INT32_ROOMS, IdSources, RoomAllocator, SnowflakeIds
from sidecar.protocol.context import HandoffContext, PrefillTarget, Route

#: 2026-01-01T00:00:00Z: the contracts.md vector instant.
FIXED_NOW_MS = 1_767_225_600_000


def make_ctx(
    route: Route = Route.COMPLETIONS,
    *,
    host: str = "10.0.0.7",
    port: int = 8200,
    advertise_host: str | None = None,
    **ids: Any,
) -> HandoffContext:
    return HandoffContext(
        route=route,
        request_id="req-1",
        prefill=PrefillTarget(host=host, port=port),
        advertise_host=advertise_host or host,
        **ids,
    )


def make_ids(*, machine_id: int = 0, max_room: int = INT32_ROOMS) -> IdSources:
    return IdSources(
        snowflake=SnowflakeIds(machine_id, clock_ms=lambda: FIXED_NOW_MS),
        rooms=RoomAllocator(max_room),
        transfer_id=lambda: "xfer-fixed",
    )


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
