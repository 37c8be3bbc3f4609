"""How many tokens a prompt has, without a tokenizer (pure; conditional disaggregation).

- ``exact_tokens``: a prompt given as token ids (completions, ``token_ids`` of the generate
  route) has exactly that many (``exact_token_ids``: those ids);
- ``estimate_tokens``: a text or chat prompt is estimated from its UTF-8 bytes: bytes / 4,
  rounded up (chat, Messages, Responses items: the text of every message, plus 4 per message
  for the template's role markers; the Messages ``system`` and Responses ``instructions``
  text counts too). Multimodal parts are not counted.

The estimate's measured error: docs/driving/request-shapes.md. Imports only the standard library
and ``sidecar.protocol.context``, so it runs in an engine's environment too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

from sidecar.protocol.context import Route

#: Bytes per token of the estimate (typical of BPE vocabularies on English text).
BYTES_PER_TOKEN: Final = 4
#: Tokens a chat template adds per message (role markers, separators), estimated.
TOKENS_PER_MESSAGE: Final = 4


def exact_token_ids(route: Route, body: Mapping[str, Any]) -> list[Any] | None:
    """The prompt's token ids when it is given as token ids (one prompt), else None."""
    if route is Route.GENERATE:
        ids = body.get("token_ids")
        return ids if isinstance(ids, list) and ids else None
    if route is not Route.COMPLETIONS:
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], list):
            return prompt[0] if len(prompt) == 1 else None
        if not isinstance(prompt[0], str):
            return prompt
    return None


def exact_tokens(route: Route, body: Mapping[str, Any]) -> int | None:
    """The prompt's token count when it is given as token ids, else None."""
    ids = exact_token_ids(route, body)
    return None if ids is None else len(ids)


def _text_bytes(content: object) -> int:
    if isinstance(content, str):
        return len(content.encode())
    if isinstance(content, list):  # content parts: count the text ones
        return sum(_text_bytes(part.get("text")) for part in content if isinstance(part, dict))
    return 0


def estimate_tokens(route: Route, body: Mapping[str, Any]) -> int:
    """The byte-based estimate of a text or chat prompt's token count."""
    if route is Route.COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        return math.ceil(_text_bytes(prompt) / BYTES_PER_TOKEN)
    if route is Route.RESPONSES:
        items = body.get("input")
        if not isinstance(items, list):
            items = [{"content": items}]
        extra = _text_bytes(body.get("instructions"))
    else:
        items = body.get("messages") or ()
        extra = _text_bytes(body.get("system")) if route is Route.MESSAGES else 0
    if not isinstance(items, list | tuple):
        items = ()
    text = extra + sum(_text_bytes(m.get("content")) for m in items if isinstance(m, dict))
    return math.ceil(text / BYTES_PER_TOKEN) + TOKENS_PER_MESSAGE * len(items)
