"""The SGLang engine handler: bootstrap host, port and room on both legs, sent concurrently.

SGLang pairs a prefill and a decode request through the prefill engine's bootstrap server:
both bodies carry the same ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room``
(contracts.md section 3), and the prefill blocks until the decode connects, so the legs run
at the same time.

    assign_ids: room := ids.rooms.allocate()   (the orchestrator releases ctx.sglang_room)
    prefill fields == decode fields == {bootstrap_host, bootstrap_port, bootstrap_room, rid}

Both legs also carry ``rid`` (SGLang's request id field), so the sidecar can name the request
in ``POST /abort_request`` when the client goes away or the prefill fails. The fields are set
after the client's keys, so client-supplied bootstrap values are always overwritten.

Deliberate limits: one room per request; batches (one room per item) are refused earlier by
``sidecar.protocol.request``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sidecar.engines.base import EngineHandler
from sidecar.errors import SidecarError
from sidecar.ids import IdSources
from sidecar.protocol.context import HandoffContext

BOOTSTRAP_HOST = "bootstrap_host"
BOOTSTRAP_PORT = "bootstrap_port"
BOOTSTRAP_ROOM = "bootstrap_room"
#: SGLang's request id field on its OpenAI routes; ``POST /abort_request {"rid"}`` names it.
RID = "rid"
ABORT_PATH = "/abort_request"


class SGLangHandler(EngineHandler):
    """Concurrent legs paired by a bootstrap room unique among in-flight requests."""

    name = "sglang"
    checked_against = "SGLang main (2026 snapshot): bootstrap_host/port/room on the OpenAI routes"

    handoff_keys = frozenset({BOOTSTRAP_HOST, BOOTSTRAP_PORT, BOOTSTRAP_ROOM})

    @property
    def concurrent(self) -> bool:
        return True

    def assign_ids(self, ctx: HandoffContext, ids: IdSources) -> HandoffContext:
        return ctx.with_ids(sglang_room=ids.rooms.allocate())

    def prefill_fields(self, ctx: HandoffContext) -> dict[str, Any]:
        return self._bootstrap_fields(ctx)

    def handoff(
        self, prefill_response: Mapping[str, Any] | None, ctx: HandoffContext
    ) -> dict[str, Any]:
        # The decode leg is built before the prefill answers: same three values, same room.
        return self._bootstrap_fields(ctx)

    @staticmethod
    def _bootstrap_fields(ctx: HandoffContext) -> dict[str, Any]:
        if ctx.sglang_room is None:
            raise SidecarError("SGLang request has no bootstrap room (assign_ids not called)")
        return {
            BOOTSTRAP_HOST: ctx.advertise_host,
            BOOTSTRAP_PORT: ctx.sglang_bootstrap_port,
            BOOTSTRAP_ROOM: ctx.sglang_room,
            RID: request_rid(ctx),
        }

    def abort_call(self, ctx: HandoffContext) -> tuple[str, dict[str, Any]] | None:
        if ctx.sglang_room is None:
            return None
        return ABORT_PATH, {RID: request_rid(ctx)}


def request_rid(ctx: HandoffContext) -> str:
    """The engine-side id of this request's legs: unique among requests in flight (the room
    is), and carrying the client's request id for log correlation."""
    return f"{ctx.request_id}-{ctx.sglang_room}"
