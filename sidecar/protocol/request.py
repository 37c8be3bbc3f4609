"""Checks on a client's OpenAI body before a prefill/decode flow starts.

    checks = BodyChecks(handoff_fields)          once: the hand-off keys the dialects own
    raw bytes ──checks.parse(raw, route)──▶ ClientRequest(route, body, stream)
                                      └──▶ InvalidRequest (HTTP 400) with a clear message

This runs on every PD request, so it reads only the fields the sidecar itself acts on and
leaves everything else to the engine: no model of the whole body. Refused:

- malformed JSON, or a body that is not an object, or one nested deeper than the sidecar can
  write back out (``jsonutil.MAX_DEPTH``: 254 levels);
- wrong types of ``stream``, ``max_tokens``, ``max_completion_tokens``, ``min_tokens``, ``n``,
  ``prompt`` (completions) and ``messages`` (chat);
- hand-off fields sent by the client (only a trusted router may set them; engines would
  otherwise act on foreign KV coordinates);
- duplicated top-level control keys (orjson silently keeps the last one; another parser on
  the path may keep the first);
- a ``prompt`` array that mixes strings and token-id arrays, or holds an empty one.

``n > 1`` and batched prompts (an array of several strings or of several token-id arrays)
are accepted and described by ``ClientRequest.batch`` and ``.n``: the core runs them as one
PD pair per (prompt, choice) (``sidecar.protocol.fanout``).

Duplicate detection is cheap: a key the body holds is re-checked only when its quoted name
occurs more than once in the raw bytes, and then the top level is re-parsed with the standard
library's ``object_pairs_hook`` to confirm. Deliberate limit: a duplicate spelled with escapes
(``"max\\u005ftokens"``) is not detected; the sidecar forwards re-serialized bodies, so the
engines see the same single value the sidecar read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sidecar import jsonutil
from sidecar.errors import InvalidRequest
from sidecar.protocol.context import Route

STREAM = "stream"
N = "n"
PROMPT = "prompt"
MESSAGES = "messages"

#: Token-limit fields the sidecar rewrites on the prefill leg: int or null.
INT_OR_NULL_FIELDS: tuple[str, ...] = ("max_tokens", "max_completion_tokens", "min_tokens")

#: Top-level keys that must not occur twice (and every hand-off key, ``BodyChecks``).
CONTROL_KEYS: frozenset[str] = frozenset(
    {
        "max_tokens",
        "max_completion_tokens",
        "min_tokens",
        "min_completion_tokens",
        STREAM,
        "stream_options",
        N,
    }
)


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """A checked client request: its route, parsed body and whether it streams."""

    route: Route
    body: dict[str, Any]
    stream: bool
    #: The prompts of a batched completions request (two or more), else None.
    batch: list[str | list[int]] | None = None
    #: Choices asked per prompt (``n``; 1 when absent or below 1, which the engine judges).
    n: int = 1

    @property
    def sub_requests(self) -> int:
        """How many PD pairs the request needs: prompts x choices."""
        return (len(self.batch) if self.batch else 1) * self.n


_type_name = jsonutil.type_name


def _is_int(value: object) -> bool:
    # JSON true/false parse to bool, a subclass of int in Python.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_ids(value: list[Any]) -> bool:
    return all(_is_int(item) for item in value)


def _check_duplicates(raw: bytes, body: dict[str, Any], quoted: Mapping[str, bytes]) -> None:
    suspects = [key for key in body.keys() & quoted.keys() if raw.count(quoted[key]) > 1]
    if not suspects:
        return
    # The hook sees every object, innermost first; the top level comes back as the result.
    pairs: list[tuple[str, Any]] = json.loads(raw, object_pairs_hook=lambda p: p)
    counts: dict[str, int] = {}
    for key, _ in pairs:
        counts[key] = counts.get(key, 0) + 1
    duplicated = sorted(key for key in suspects if counts.get(key, 0) > 1)
    if duplicated:
        raise InvalidRequest(
            "duplicated top-level key(s) in request body: " + ", ".join(duplicated)
        )


def _check_types(body: dict[str, Any], route: Route) -> None:
    stream = body.get(STREAM)
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest(f"'stream' must be a boolean, got {_type_name(stream)}")
    for key in INT_OR_NULL_FIELDS:
        value = body.get(key)
        if value is not None and not _is_int(value):
            raise InvalidRequest(f"'{key}' must be an integer or null, got {_type_name(value)}")
    n = body.get(N)
    if n is not None and not _is_int(n):
        raise InvalidRequest(f"'n' must be an integer, got {_type_name(n)}")
    if route is Route.COMPLETIONS:
        _check_prompt(body)
    else:
        _check_messages(body)


def _check_prompt(body: dict[str, Any]) -> None:
    if PROMPT not in body:
        raise InvalidRequest("'prompt' is required")
    prompt = body[PROMPT]
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, list):
        raise InvalidRequest(
            f"'prompt' must be a string or an array of token ids, got {_type_name(prompt)}"
        )
    if not prompt:
        raise InvalidRequest("'prompt' must not be an empty array")
    if _is_token_ids(prompt):
        return
    if all(isinstance(item, str) for item in prompt):
        return
    if all(isinstance(item, list) and item and _is_token_ids(item) for item in prompt):
        return
    raise InvalidRequest(
        "'prompt' must be a string, an array of token ids, or an array of strings or of "
        "non-empty token-id arrays (not both)"
    )


def _check_messages(body: dict[str, Any]) -> None:
    messages = body.get(MESSAGES)
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array of objects")
    if not all(isinstance(message, dict) for message in messages):
        raise InvalidRequest("'messages' must be a non-empty array of objects")


class BodyChecks:
    """The checks of one sidecar's client bodies.

    ``handoff_fields`` are the top-level keys only the sidecar (or a trusted router) may set:
    the engines' hand-off coordinates, as every dialect declares them
    (``sidecar.dialects.handoff_keys``); a client sending one is refused, since an engine
    would otherwise act on foreign KV coordinates.
    """

    def __init__(self, handoff_fields: Iterable[str]) -> None:
        self.handoff_fields: tuple[str, ...] = tuple(sorted(set(handoff_fields)))
        self._quoted: dict[str, bytes] = {
            key: f'"{key}"'.encode() for key in CONTROL_KEYS | set(self.handoff_fields)
        }

    def parse(self, raw: bytes, route: Route, *, trusted_router: bool = False) -> ClientRequest:
        """Parse and check a client body; raises ``InvalidRequest`` naming what is wrong.

        ``trusted_router`` allows the hand-off fields (a router that computed them itself).
        """
        try:
            body = jsonutil.loads(raw)
        except jsonutil.JSONDecodeError:
            raise InvalidRequest("request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise InvalidRequest(f"request body must be a JSON object, got {_type_name(body)}")
        if jsonutil.too_deep(body, raw):
            # It would parse, but not be written again for the engines (orjson's limit).
            raise InvalidRequest(
                f"request body nests objects and arrays more than {jsonutil.MAX_DEPTH} levels "
                "deep"
            )
        if not trusted_router:
            sent = [key for key in self.handoff_fields if key in body]
            if sent:
                raise InvalidRequest(
                    "hand-off field(s) may not be sent by the client: " + ", ".join(sent)
                )
        _check_duplicates(raw, body, self._quoted)
        _check_types(body, route)
        n = body.get(N)
        return ClientRequest(
            route=route,
            body=body,
            stream=body.get(STREAM) is True,
            batch=_batch(body) if route is Route.COMPLETIONS else None,
            n=n if isinstance(n, int) and n > 1 else 1,
        )


def _batch(body: dict[str, Any]) -> list[str | list[int]] | None:
    """The prompts of a checked completions body holding several, else None."""
    prompt = body[PROMPT]
    if isinstance(prompt, list) and len(prompt) > 1 and not _is_token_ids(prompt):
        return list(prompt)
    return None
