"""The rules common to every prefill leg (docs/driving/handoffs.md#common-rules), in one place.

    client body ──api_of(route).prefill_base()──▶ prefill body (+ the dialect's fields)
    client body ──merge_top_level(handoff)──▶ decode body

Each API's own prefill rules (its limit field, stream, what the prefill must not keep) are
its module's (``sidecar.protocol.apis``); ``prefill_base`` names the OpenAI routes' here.

Only top-level keys are touched, and inputs are never mutated: ``messages``, ``tools`` and
every nested value stay the very objects the client sent (stable tokenization, prefix-cache
hits), and a key the client omitted stays omitted on the decode leg.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sidecar.protocol.apis.base import PREFILL_MAX_TOKENS, STREAM, STREAM_OPTIONS
from sidecar.protocol.apis.completions import (
    MAX_COMPLETION_TOKENS,
    MAX_TOKENS,
    MIN_COMPLETION_TOKENS,
    MIN_TOKENS,
    openai_prefill_base,
)

__all__ = [
    "MAX_COMPLETION_TOKENS", "MAX_TOKENS", "MIN_COMPLETION_TOKENS", "MIN_TOKENS",
    "PREFILL_MAX_TOKENS", "STREAM", "STREAM_OPTIONS", "merge_top_level", "prefill_base",
]

#: The OpenAI routes' prefill rules (every API's are in ``sidecar.protocol.apis``).
prefill_base = openai_prefill_base


def merge_top_level(body: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``body`` with ``fields`` set at the top level (values are not copied)."""
    merged = dict(body)
    merged.update(fields)
    return merged
