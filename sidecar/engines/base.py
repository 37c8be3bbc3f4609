"""The engine handler interface: one implementation per engine family.

A handler turns the client's body into the engine's prefill body, says whether the two legs
run one after the other or at the same time, and turns the prefill response into the fields
the decode body gets (the *hand-off*). Handlers are pure; the orchestrator does the I/O.

    client body ─prefill_body()─▶ POST prefill ─▶ response ─handoff()─▶ fields
    client body + fields ─decode_body()─▶ POST decode (local engine)

An engine whose hand-off goes through a KV transfer agent (vLLM) gets its agent bound when the
runtime is built (``bind``): nothing downstream passes an agent around. Each handler declares
what it owns on the wire: ``handoff_keys`` (top-level body keys only the sidecar may set;
clients are refused them) and ``token_id_fields`` (the request keys that make a streamed
completion carry generated token ids, which the gRPC front door needs).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

from sidecar.ids import IdSources
from sidecar.kv_agents.base import KVTransferAgent
from sidecar.protocol.common import merge_top_level, prefill_base
from sidecar.protocol.context import HandoffContext

#: vLLM's (and SGLang's) documented switch for token ids on a streamed completion.
RETURN_TOKEN_IDS: Mapping[str, Any] = MappingProxyType({"return_token_ids": True})


class EngineHandler(ABC):
    """Engine-specific behaviour of a prefill/decode pair (with its KV agent, if any)."""

    #: The wire name (pod label value), e.g. "vllm".
    name: ClassVar[str]
    #: True when the engine rejects ``max_completion_tokens`` on the prefill leg.
    drops_max_completion_tokens: ClassVar[bool] = False
    #: True when this engine's hand-off goes through a KV transfer agent (vLLM).
    uses_kv_agent: ClassVar[bool] = False
    #: The engine versions whose wire format this handler was checked against.
    checked_against: ClassVar[str] = ""
    #: Top-level body keys of this engine's own hand-off (its agent declares its own).
    handoff_keys: ClassVar[frozenset[str]] = frozenset()
    #: Top-level request fields that make a streamed completion carry token ids.
    token_id_fields: ClassVar[Mapping[str, Any]] = RETURN_TOKEN_IDS

    def __init__(self, agent: KVTransferAgent | None = None) -> None:
        #: The KV transfer agent bound to this handler (engines that use one).
        self.agent = agent if self.uses_kv_agent else None

    def bind(self, agent: KVTransferAgent | None) -> EngineHandler:
        """This handler with ``agent`` bound (a new instance; handlers are immutable)."""
        return type(self)(agent)

    @property
    def connector_name(self) -> str | None:
        """The bound agent's wire name, or None for engines without one."""
        return self.agent.name if self.agent is not None else None

    @property
    def concurrent(self) -> bool:
        """True when prefill and decode are sent at the same time."""
        return False

    @property
    def needs_engine_id(self) -> bool:
        """True when the decode body needs the prefill's engine id (looked up by the core)."""
        return False

    def parse_engine_id(self, payload: object) -> str:
        """The prefill engine id from its bootstrap ``/query`` answer (``needs_engine_id``)."""
        raise NotImplementedError(f"{self.name} needs no engine id")

    def assign_ids(self, ctx: HandoffContext, ids: IdSources) -> HandoffContext:
        """Fill the per-request ids the hand-off needs (rooms, disagg ids, transfer ids)."""
        return ctx

    def prefill_body(
        self, client_body: Mapping[str, Any], ctx: HandoffContext
    ) -> dict[str, Any]:
        """The body POSTed to the prefill engine: the common rules plus engine fields."""
        body = prefill_base(
            client_body, drop_max_completion_tokens=self.drops_max_completion_tokens
        )
        body.update(self.prefill_fields(ctx))
        return body

    @abstractmethod
    def prefill_fields(self, ctx: HandoffContext) -> dict[str, Any]:
        """Engine-specific top-level fields of the prefill body."""

    @abstractmethod
    def handoff(
        self, prefill_response: Mapping[str, Any] | None, ctx: HandoffContext
    ) -> dict[str, Any]:
        """Top-level fields the decode body gets; raises ``InvalidHandoff`` when unusable."""

    def abort_call(self, ctx: HandoffContext) -> tuple[str, dict[str, Any]] | None:
        """The engine's abort endpoint and body for this request's legs, if it has one."""
        return None

    def answered_by_prefill(self, prefill_response: Mapping[str, Any]) -> bool:
        """True when the prefill response already is the whole answer (TRT-LLM)."""
        return False

    def prefill_answer(self, prefill_response: Mapping[str, Any]) -> dict[str, Any]:
        """A prefill response that is the whole answer, as the client sees it."""
        return dict(prefill_response)

    def decode_body(
        self, client_body: Mapping[str, Any], handoff: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The decode body: the *original* client body with the hand-off fields set."""
        return merge_top_level(client_body, handoff)
