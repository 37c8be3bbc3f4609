"""The vLLM engine handler: every hand-off field comes from the KV transfer agent.

vLLM's hand-off lives in ``kv_transfer_params``, whose shape depends on the KV connector the
pods run (NIXL pull, Neuron NIXL, Mooncake push, ...). This handler only delegates: the agent
decides the fields, the ids and whether the legs run concurrently, so a new connector needs
no change here.

    prefill body = common rules + agent.prefill_fields(ctx)
    decode fields = agent.handoff(prefill response, ctx)

Deliberate limits: a vLLM flow without an agent is a wiring bug, not a request error; it
raises ``SidecarError`` (HTTP 500) instead of silently running without a hand-off.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sidecar.engines.base import EngineHandler
from sidecar.errors import SidecarError
from sidecar.ids import IdSources
from sidecar.kv_agents.base import KVTransferAgent
from sidecar.protocol.context import HandoffContext


def _require(agent: KVTransferAgent | None) -> KVTransferAgent:
    if agent is None:
        raise SidecarError("the vllm engine handler needs a KV transfer agent")
    return agent


class VLLMHandler(EngineHandler):
    """Delegates ids, prefill fields, concurrency and the hand-off to the KV agent."""

    name = "vllm"
    uses_kv_agent = True
    checked_against = "vLLM main (2026 snapshot): kv_transfer_params on the OpenAI routes"

    def concurrent(self, agent: KVTransferAgent | None) -> bool:
        return _require(agent).concurrent

    def assign_ids(
        self, ctx: HandoffContext, ids: IdSources, agent: KVTransferAgent | None
    ) -> HandoffContext:
        return _require(agent).assign_ids(ctx, ids)

    def prefill_fields(
        self, ctx: HandoffContext, agent: KVTransferAgent | None
    ) -> dict[str, Any]:
        return _require(agent).prefill_fields(ctx)

    def handoff(
        self,
        prefill_response: Mapping[str, Any] | None,
        ctx: HandoffContext,
        agent: KVTransferAgent | None,
    ) -> dict[str, Any]:
        return _require(agent).handoff(prefill_response, ctx)
