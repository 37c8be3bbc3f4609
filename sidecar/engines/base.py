"""The engine handler interface: one implementation per engine family.

A handler turns the client's body into the engine's prefill body, says whether the two legs
run one after the other or at the same time, and turns the prefill response into the fields
the decode body gets (the *hand-off*). Handlers are pure; the orchestrator does the I/O.

    client body ─prefill_body()─▶ POST prefill ─▶ response ─handoff()─▶ fields
    client body + fields ─decode_body()─▶ POST decode (local engine)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

from sidecar.ids import IdSources
from sidecar.kv_agents.base import KVTransferAgent
from sidecar.protocol.common import merge_top_level, prefill_base
from sidecar.protocol.context import HandoffContext


class EngineHandler(ABC):
    """Engine-specific behaviour of a prefill/decode pair."""

    #: The wire name (pod label value), e.g. "vllm".
    name: ClassVar[str]
    #: True when the engine rejects ``max_completion_tokens`` on the prefill leg.
    drops_max_completion_tokens: ClassVar[bool] = False
    #: True when this engine's hand-off goes through a KV transfer agent (vLLM).
    uses_kv_agent: ClassVar[bool] = False
    #: The engine versions whose wire format this handler was checked against.
    checked_against: ClassVar[str] = ""

    def concurrent(self, agent: KVTransferAgent | None) -> bool:
        """True when prefill and decode are sent at the same time."""
        return False

    def assign_ids(
        self, ctx: HandoffContext, ids: IdSources, agent: KVTransferAgent | None
    ) -> HandoffContext:
        """Fill the per-request ids the hand-off needs (rooms, disagg ids, transfer ids)."""
        return ctx

    def prefill_body(
        self,
        client_body: Mapping[str, Any],
        ctx: HandoffContext,
        agent: KVTransferAgent | None,
    ) -> dict[str, Any]:
        """The body POSTed to the prefill engine: the common rules plus engine fields."""
        body = prefill_base(
            client_body, drop_max_completion_tokens=self.drops_max_completion_tokens
        )
        body.update(self.prefill_fields(ctx, agent))
        return body

    @abstractmethod
    def prefill_fields(
        self, ctx: HandoffContext, agent: KVTransferAgent | None
    ) -> dict[str, Any]:
        """Engine-specific top-level fields of the prefill body."""

    @abstractmethod
    def handoff(
        self,
        prefill_response: Mapping[str, Any] | None,
        ctx: HandoffContext,
        agent: KVTransferAgent | None,
    ) -> dict[str, Any]:
        """Top-level fields the decode body gets; raises ``InvalidHandoff`` when unusable."""

    def abort_call(self, ctx: HandoffContext) -> tuple[str, dict[str, Any]] | None:
        """The engine's abort endpoint and body for this request's legs, if it has one."""
        return None

    def answered_by_prefill(self, prefill_response: Mapping[str, Any]) -> bool:
        """True when the prefill response already is the whole answer (TRT-LLM)."""
        return False

    def decode_body(
        self, client_body: Mapping[str, Any], handoff: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The decode body: the *original* client body with the hand-off fields set."""
        return merge_top_level(client_body, handoff)
