"""Builders shared by the stub-engine tests: bodies with keyword defaults, a client session."""

from __future__ import annotations

from typing import Any

from protocol_builders import nixl_prefill_skeleton

#: The NIXL prefill leg's ``kv_transfer_params`` (the one builder's, shared by every suite).
NIXL_PREFILL_PARAMS: dict[str, Any] = nixl_prefill_skeleton()


def completion(
    prompt: Any = "Hello, stub world", *, max_tokens: int = 6, **extra: Any
) -> dict[str, Any]:
    return {"model": "stub-model", "prompt": prompt, "max_tokens": max_tokens, **extra}


def chat(content: str = "Hello, stub", *, max_tokens: int = 6, **extra: Any) -> dict[str, Any]:
    return {
        "model": "stub-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        **extra,
    }


def sse_events(text: str) -> list[Any]:
    """The data payloads of an SSE body ("[DONE]" kept as a string)."""
    import json

    out: list[Any] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out
