"""OpenAI request bodies the sidecar tests send through the HTTP front door."""

from __future__ import annotations

from typing import Any

from sidecar.protocol.context import Route


def client_body(
    route: Route = Route.COMPLETIONS,
    *,
    stream: bool = False,
    max_tokens: int = 6,
    prompt: str = "Disaggregated serving splits prefill and decode.",
    **extra: Any,
) -> dict[str, Any]:
    """A completions body (``prompt``) or a chat body (one user message) for the stubs."""
    body: dict[str, Any] = {"model": "stub-model", "max_tokens": max_tokens, "stream": stream}
    if route is Route.COMPLETIONS:
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    body.update(extra)
    return body
