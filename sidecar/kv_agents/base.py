"""The KV transfer agent interface: one implementation per vLLM KV connector.

An agent owns the connector-specific part of a vLLM hand-off: fields added to the prefill
body, whether the legs run one after the other (pull: NIXL) or at the same time (push:
Mooncake), and the fields the decode body gets from the prefill response. Agents are pure:
per-request ids and looked-up values arrive in the ``HandoffContext``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

from sidecar.ids import IdSources
from sidecar.protocol.context import HandoffContext


class KVTransferAgent(ABC):
    """Connector-specific request and response mutation for one KV transfer backend."""

    #: The wire name (pod label value), e.g. "shfs".
    name: ClassVar[str]
    #: Engines this agent's hand-off is meaningful for.
    engines: ClassVar[frozenset[str]] = frozenset({"vllm"})
    #: True when prefill and decode are sent at the same time.
    concurrent: ClassVar[bool] = False
    #: True when the decode body needs the prefill's engine id from its bootstrap ``/query``.
    needs_engine_id: ClassVar[bool] = False
    #: The engine versions whose wire format this agent was checked against.
    checked_against: ClassVar[str] = ""
    #: Top-level body keys of this agent's hand-off (only the sidecar may set them).
    handoff_keys: ClassVar[frozenset[str]] = frozenset()

    def parse_engine_id(self, payload: object) -> str:
        """The prefill engine id from its bootstrap ``/query`` answer (``needs_engine_id``)."""
        raise NotImplementedError(f"the {self.name} agent needs no engine id")

    def assign_ids(self, ctx: HandoffContext, ids: IdSources) -> HandoffContext:
        """Fill the per-request ids this agent needs (default: none)."""
        return ctx

    @abstractmethod
    def prefill_fields(self, ctx: HandoffContext) -> dict[str, Any]:
        """Top-level fields to set on the prefill body."""

    @abstractmethod
    def handoff(
        self, prefill_response: Mapping[str, Any] | None, ctx: HandoffContext
    ) -> dict[str, Any]:
        """Top-level fields to set on the decode body.

        ``prefill_response`` is None for concurrent agents (decode is built before the prefill
        answers). Raises ``InvalidHandoff`` when the response lacks what decode needs.
        """
