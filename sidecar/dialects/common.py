"""The rules common to every prefill leg (docs/handoffs.md#common-rules), in one place.

    client body ──prefill_base()──▶ prefill body (+ engine/agent fields)
    client body ──merge_top_level(handoff)──▶ decode body

Only top-level keys are touched, and inputs are never mutated: ``messages``, ``tools`` and
every nested value stay the very objects the client sent (stable tokenization, prefix-cache
hits), and a key the client omitted stays omitted on the decode leg.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAX_TOKENS = "max_tokens"
MAX_COMPLETION_TOKENS = "max_completion_tokens"
MIN_TOKENS = "min_tokens"
MIN_COMPLETION_TOKENS = "min_completion_tokens"
STREAM = "stream"
STREAM_OPTIONS = "stream_options"

#: The prefill leg computes the prompt's KV and one token, nothing more.
PREFILL_MAX_TOKENS = 1


def prefill_base(
    client_body: Mapping[str, Any], *, drop_max_completion_tokens: bool = False
) -> dict[str, Any]:
    """The client body as a prefill leg: one token, not streamed, no lower token bounds;
    ``max_completion_tokens`` capped only when the client sent it (vLLM's reference proxy; vLLM
    prefers it over ``max_tokens`` on chat), or deleted for engines that reject it (TRT-LLM)."""
    body = dict(client_body)
    body[MAX_TOKENS] = PREFILL_MAX_TOKENS
    if drop_max_completion_tokens:
        body.pop(MAX_COMPLETION_TOKENS, None)
    elif MAX_COMPLETION_TOKENS in body:
        body[MAX_COMPLETION_TOKENS] = PREFILL_MAX_TOKENS
    # vLLM rejects min_tokens > max_tokens; a one-token prefill cannot honour them.
    body.pop(MIN_TOKENS, None)
    body.pop(MIN_COMPLETION_TOKENS, None)
    # vLLM returns kv_transfer_params only on non-streamed responses.
    body[STREAM] = False
    body.pop(STREAM_OPTIONS, None)
    return body


def merge_top_level(body: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``body`` with ``fields`` set at the top level (values are not copied)."""
    merged = dict(body)
    merged.update(fields)
    return merged
