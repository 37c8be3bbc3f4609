"""The default dialect: a plain prefill-then-decode flow with no hand-off fields.

An engine the registry does not know resolves here (docs/handoffs.md#default-engine): the
common prefill rules (one token, not streamed) and a decode leg built from the original
client body. Deliberate limits: no KV hand-off; the decode engine recomputes the prompt unless
it shares a cache with the prefill engine by some means outside the request bodies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sidecar.dialects.base import Dialect
from sidecar.protocol.context import HandoffContext


class DefaultDialect(Dialect):
    """No augmentation, sequential legs, empty hand-off."""

    engine = "default"
    checked_against = "any OpenAI-compatible engine (no engine-specific fields)"

    def handoff(
        self, prefill_response: Mapping[str, Any] | None, ctx: HandoffContext
    ) -> dict[str, Any]:
        return {}
