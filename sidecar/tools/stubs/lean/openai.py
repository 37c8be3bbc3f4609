"""``/v1/completions`` for the lean bench engine: parse a body, render JSON or SSE answers.

    parse(body bytes)  ─▶ Completion (prompt ids' count and digest, max_tokens, stream, ...)
    tokens(digest, n, kind) ─▶ the generated words (cached: the bench repeats one prompt)
    render_json(...)   ─▶ one completion body (vLLM's or SGLang's extras)
    render_events(...) ─▶ SSE events: one per token, [usage,] ``data: [DONE]``

Token ids, words and the remote/local distinction are the aiohttp stubs' own
(``sidecar.tools.stubs.textgen``): a decode that used the prefill's KV answers lowercase words, a
local recompute UPPERCASE ones, so a broken hand-off shows in the text.

Deliberate limits: completions only (no chat), one string prompt or one list of token ids,
``n`` = 1, no logprobs or echo, no EOS (finish is always ``length``); error wording follows
vLLM's for the checks it makes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import orjson

from sidecar.tools.stubs import textgen
from sidecar.tools.stubs.openai import BadRequest, check_limits, usage
from sidecar.tools.stubs.textgen import PrefillKind

DONE: Final = b"data: [DONE]\n\n"
_CACHE_LIMIT: Final = 4096


@dataclass(frozen=True, slots=True)
class Words:
    """Generated words: each as a JSON string (for events) and all joined (for bodies), and
    their token ids (each as a JSON list, for ``return_token_ids`` events)."""

    each: tuple[bytes, ...]
    text: str
    ids: tuple[bytes, ...] = ()


@dataclass(slots=True)
class Completion:
    body: dict[str, Any]
    prompt_tokens: int
    digest: int
    max_tokens: int
    stream: bool
    include_usage: bool
    model: str
    #: ``return_token_ids``: each chunk's ids and the prompt's (vLLM's placement).
    return_token_ids: bool = False


_prompts: dict[str, tuple[int, int]] = {}
_words: dict[tuple[int, int, PrefillKind], Words] = {}


def _prompt(prompt: Any) -> tuple[int, int]:
    """(token count, digest) of a prompt, remembered per string prompt."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        known = _prompts.get(prompt)
        if known is not None:
            return known
        if not prompt:
            raise BadRequest("prompt cannot be empty")
        ids = textgen.encode_text(prompt)
        if len(_prompts) >= _CACHE_LIMIT:
            _prompts.clear()
        known = _prompts[prompt] = (len(ids), textgen.prompt_digest(ids))
        return known
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return len(prompt), textgen.prompt_digest(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest("the lean engine serves one prompt per request (got a batch)")
    raise BadRequest("prompt must be a string or a non-empty list of token ids")


def _prompt_ids(prompt: Any) -> list[int]:
    """A prompt's token ids (for the first chunk of a stream that asked for them)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    return textgen.encode_text(prompt) if isinstance(prompt, str) else list(prompt)


def parse(raw: bytes, *, default_max_tokens: int, max_model_len: int, model: str) -> Completion:
    """Check a completions body as vLLM would (the subset the lean engine serves)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadRequest("Expecting value: request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    prompt_tokens, digest = _prompt(body.get("prompt"))
    max_tokens, stream, options = check_limits(
        body, prompt_tokens, default_max_tokens=default_max_tokens,
        max_model_len=max_model_len, engine="lean",
    )
    name = body.get("model")
    return Completion(
        body=body,
        prompt_tokens=prompt_tokens,
        digest=digest,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        model=name if isinstance(name, str) else model,
        return_token_ids=body.get("return_token_ids") is True,
    )


def words(digest: int, n: int, kind: PrefillKind) -> Words:
    """The ``n`` generated words (as ``textgen.generate``, no EOS)."""
    key = (digest, n, kind)
    known = _words.get(key)
    if known is None:
        ids, _ = textgen.generate(digest, n, kind)
        texts = [textgen.token_text(t) for t in ids]
        if len(_words) >= _CACHE_LIMIT:
            _words.clear()
        known = _words[key] = Words(tuple(orjson.dumps(t) for t in texts), "".join(texts),
                                    tuple(orjson.dumps([t]) for t in ids))
    return known


def render_json(
    c: Completion,
    response_id: str,
    created: int,
    words: Words,
    *,
    choice_extra: dict[str, Any],
    top_extra: dict[str, Any],
) -> bytes:
    """The non-streamed completion body."""
    choice = {
        "index": 0,
        "text": words.text,
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
        "prompt_logprobs": None,
        **choice_extra,
    }
    return orjson.dumps({
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": c.model,
        "choices": [choice],
        "usage": usage(c.prompt_tokens, len(words.each)),
        **top_extra,
    })


def render_events(
    c: Completion, response_id: str, created: int, words: Words, *, choice_extra: bytes,
    token_ids: bool = False,
) -> Iterator[bytes]:
    """One ``data:`` event per token (vLLM's completion chunk shape), then ``[DONE]``;
    ``token_ids``: vLLM's ``prompt_token_ids`` and ``token_ids`` keys in each chunk (the
    prompt's and the chunk's ids when ``return_token_ids`` asked, else null)."""
    head = orjson.dumps(
        {"id": response_id, "object": "text_completion", "created": created, "model": c.model}
    )
    prefix = b"data: " + head[:-1] + b',"choices":[{"index":0,"text":'
    texts = words.each
    last = len(texts) - 1
    unasked = b',"prompt_token_ids":null,"token_ids":null'
    for i, text in enumerate(texts):
        finish = b'"length"' if i == last else b"null"
        ids = choice_extra
        if token_ids and not c.return_token_ids:
            ids = unasked
        elif token_ids:
            prompt = orjson.dumps(_prompt_ids(c.body.get("prompt"))) if i == 0 else b"null"
            ids = b',"prompt_token_ids":' + prompt + b',"token_ids":' + words.ids[i]
        yield b"".join((
            prefix, text, b',"logprobs":null,"finish_reason":', finish,
            b',"stop_reason":null', ids, b'}],"usage":null}\n\n',
        ))
    if c.include_usage:
        tail = {"choices": [], "usage": usage(c.prompt_tokens, len(texts))}
        yield b"data: " + head[:-1] + b"," + orjson.dumps(tail)[1:] + b"\n\n"
    yield DONE
