"""The usage rule for OpenAI-shaped usage (completions, chat, token-in generate), pure.

    {"prompt_tokens", "completion_tokens", "total_tokens",
     "prompt_tokens_details": {"cached_tokens", "created_cache_tokens", ...} | null, ...}

``true_openai_usage``: every count from the decode leg; ``prompt_tokens_details`` (the
prompt's cache hits, and what the prefill wrote) the prefill leg's own, whole, or none when
the prefill reported none. ``summed_details`` adds up the details of several prompts (a
fanned-out request: once per prompt, as prompt tokens are).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

from sidecar.protocol.apis.fields import is_int

PROMPT_TOKENS_DETAILS: Final = "prompt_tokens_details"


def true_openai_usage(decode: Mapping[str, Any],
                      prefill: Mapping[str, Any] | None) -> dict[str, Any]:
    """``decode``'s usage with the prefill's ``prompt_tokens_details`` (or none)."""
    merged = dict(decode)
    details = prefill.get(PROMPT_TOKENS_DETAILS) if prefill is not None else None
    if not isinstance(details, Mapping):
        details = None
    if details is not None or PROMPT_TOKENS_DETAILS in merged:
        merged[PROMPT_TOKENS_DETAILS] = None if details is None else dict(details)
    return merged


def summed_details(details: Iterable[object]) -> dict[str, Any] | None:
    """Several prompts' details as one: integers added key by key, other values the first
    prompt's; None when no prompt reported any."""
    merged: dict[str, Any] | None = None
    for item in details:
        if not isinstance(item, Mapping):
            continue
        if merged is None:
            merged = dict(item)
            continue
        for key, value in item.items():
            have = merged.get(key)
            if is_int(value) and (have is None or is_int(have)):
                merged[key] = (have or 0) + value
            elif key not in merged:
                merged[key] = value
    return merged
