"""Builders shared by the stub-engine tests: bodies with keyword defaults, a client session."""

from __future__ import annotations

from typing import Any

NIXL_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


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
