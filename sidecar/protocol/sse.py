"""Turning a whole (non-streamed) OpenAI answer into the SSE events a streaming client expects.

Used only when no decode stream exists: TensorRT-LLM's context leg already finished the
answer (its own disaggregated server returns the context response as the answer).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sidecar import jsonutil
from sidecar.protocol.context import Route

DONE_EVENT = b"data: [DONE]\n\n"


def answer_as_sse(answer: Mapping[str, Any], route: Route) -> bytes:
    """One chunk event carrying the whole answer, then ``[DONE]``."""
    chunk = dict(answer)
    if route is Route.CHAT:
        chunk["object"] = "chat.completion.chunk"
        choices = []
        for choice in answer.get("choices") or []:
            if not isinstance(choice, Mapping):
                continue
            converted = {k: v for k, v in choice.items() if k != "message"}
            converted["delta"] = choice.get("message") or {}
            choices.append(converted)
        chunk["choices"] = choices
    return b"data: " + jsonutil.dumps(chunk) + b"\n\n" + DONE_EVENT
