"""The vLLM engine handler: every hand-off field comes from the bound KV transfer agent.

vLLM's hand-off lives in ``kv_transfer_params``, whose shape depends on the KV connector the
pods run (NIXL pull, Neuron NIXL, Mooncake push, ...). This handler only delegates: the agent
decides the fields, the ids and whether the legs run concurrently, so a new connector needs
no change here.

    prefill body = common rules + agent.prefill_fields(ctx)
    decode fields = agent.handoff(prefill response, ctx)

Deliberate limits: a vLLM handler without an agent is a wiring bug, not a request error; it
raises ``SidecarError`` (HTTP 500) instead of silently running without a hand-off.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sidecar.engines.base import EngineHandler
from sidecar.errors import SidecarError
from sidecar.ids import IdSources
from sidecar.protocol.context import HandoffContext


class VLLMHandler(EngineHandler):
    """Delegates ids, prefill fields, concurrency and the hand-off to the bound KV agent."""

    name = "vllm"
    uses_kv_agent = True
    checked_against = "vLLM main (2026 snapshot): kv_transfer_params on the OpenAI routes"

    # Each method checks the bound agent inline: a helper call per use would be paid on every
    # request's hot path.

    @property
    def concurrent(self) -> bool:
        if self.agent is None:
            raise _unbound()
        return self.agent.concurrent

    @property
    def needs_engine_id(self) -> bool:
        if self.agent is None:
            raise _unbound()
        return self.agent.needs_engine_id

    def parse_engine_id(self, payload: object) -> str:
        if self.agent is None:
            raise _unbound()
        return self.agent.parse_engine_id(payload)

    def assign_ids(self, ctx: HandoffContext, ids: IdSources) -> HandoffContext:
        if self.agent is None:
            raise _unbound()
        return self.agent.assign_ids(ctx, ids)

    def prefill_fields(self, ctx: HandoffContext) -> dict[str, Any]:
        if self.agent is None:
            raise _unbound()
        return self.agent.prefill_fields(ctx)

    def handoff(
        self, prefill_response: Mapping[str, Any] | None, ctx: HandoffContext
    ) -> dict[str, Any]:
        if self.agent is None:
            raise _unbound()
        return self.agent.handoff(prefill_response, ctx)


def _unbound() -> SidecarError:
    return SidecarError("the vllm engine handler needs a KV transfer agent")
