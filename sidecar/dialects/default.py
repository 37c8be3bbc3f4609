"""The default dialect: a plain prefill-then-decode flow with no hand-off fields.

Used for engines the registry does not know (docs/driving/handoffs.md#default-engine: an unknown
engine
resolves
here), so a new engine still gets the common prefill rules (one token, not streamed) and a
decode leg built from the original client body.

Routes: completions and chat; every other route runs whole on the local engine (an unknown
engine's other APIs are not known to take a prefill leg).

Deliberate limits: no KV hand-off at all; the decode engine recomputes the prompt unless it
shares a cache with the prefill engine by some means outside the request bodies.
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
