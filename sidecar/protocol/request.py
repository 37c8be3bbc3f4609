"""A client's request as the sidecar takes it: its id, and the checks on its body before a
prefill/decode pair starts (every API's route).

    X-Request-Id: <id>  ─request_id_or_new()─▶ the id when sane, else a fresh uuid4 hex

    checks = BodyChecks(handoff_fields)          once: the hand-off keys the dialects own
    raw bytes ──checks.parse(raw, route)──▶ ClientRequest(route, body, stream, batch, n)
                                      └──▶ InvalidRequest (HTTP 400) with a clear message

This runs on every PD request, so it reads only the fields the sidecar itself acts on and
leaves everything else to the engine: no model of the whole body. Refused:

- malformed JSON, or a body that is not an object, or one nested deeper than the sidecar can
  write back out (``jsonutil.MAX_DEPTH``: 254 levels);
- wrong types of the fields the route's API acts on (``Api.check``, ``sidecar.protocol.apis``:
  e.g. ``stream``, ``max_tokens``, ``n``, ``prompt`` and ``messages`` on the OpenAI routes,
  ``max_output_tokens`` on Responses, ``max_tokens`` required on Messages, ``token_ids`` and
  ``sampling_params`` on generate);
- hand-off fields sent by the client (only a trusted router may set them; engines would
  otherwise act on foreign KV coordinates);
- duplicated top-level control keys (orjson silently keeps the last one; another parser on
  the path may keep the first);
- a ``prompt`` array that mixes strings and token-id arrays, or holds an empty one.

``n > 1`` and batched prompts (completions and chat: an array of several strings or of
several token-id arrays) are accepted and described by ``ClientRequest.batch`` and ``.n``: the
core runs them as one PD pair per (prompt, choice) (``sidecar.protocol.fanout``).

Duplicate detection is cheap: a key the body holds is re-checked only when its quoted name
occurs more than once in the raw bytes, and then the top level is re-parsed with the standard
library's ``object_pairs_hook`` to confirm. Deliberate limit: a duplicate spelled with escapes
(``"max\\u005ftokens"``) is not detected; the sidecar forwards re-serialized bodies, so the
engines see the same single value the sidecar read.

The same request id rides on both engine legs, comes back to the client and names the
request in logs (over gRPC the messages' ``request_id``). A sane id is 1-200 characters of
``[A-Za-z0-9._:@/+=-]``: it can never inject a header or a log line.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any, Final

import msgspec

from sidecar import jsonutil
from sidecar.errors import InvalidRequest
from sidecar.jsonutil import type_name
from sidecar.protocol.apis import CONTROL_KEYS, api_of
from sidecar.protocol.context import Route

__all__ = ["CONTROL_KEYS", "BodyChecks", "ClientRequest"]


class ClientRequest(msgspec.Struct, frozen=True):
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


class BodyChecks:
    """The checks of one sidecar's client bodies. ``handoff_fields`` (every dialect's, from
    ``sidecar.dialects.handoff_keys``) only the sidecar or a trusted router may set: an engine
    would otherwise act on foreign KV coordinates."""

    def __init__(self, handoff_fields: Iterable[str]) -> None:
        self.handoff_fields: tuple[str, ...] = tuple(sorted(set(handoff_fields)))
        self._quoted: dict[str, bytes] = {
            key: f'"{key}"'.encode() for key in CONTROL_KEYS | set(self.handoff_fields)
        }

    def parse(self, raw: bytes, route: Route, *, trusted_router: bool = False) -> ClientRequest:
        """Parse and check a client body; raises ``InvalidRequest`` naming what is wrong
        (``trusted_router``: the hand-off fields are allowed, the router computed them)."""
        try:
            body = jsonutil.loads_exact(raw)
        except jsonutil.IntegerOutOfRange as wide:
            # orjson would have made it a float: the engines would get another number.
            where = "".join(c if c.isprintable() else "?" for c in wide.path[:128])
            raise InvalidRequest(
                f"request body field {where}: integer outside the 64-bit range "
                f"[{jsonutil.INT_MIN}, {jsonutil.INT_MAX}]") from None
        except jsonutil.JSONDecodeError:
            raise InvalidRequest("request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise InvalidRequest(f"request body must be a JSON object, got {type_name(body)}")
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
        api = api_of(route)
        api.check(body)
        return ClientRequest(
            route=route,
            body=body,
            stream=api.streams(body),
            batch=api.batch(body),
            n=api.choices(body),
        )


REQUEST_ID_HEADER: Final = "X-Request-Id"

_SAFE_REQUEST_ID: Final = re.compile(r"[A-Za-z0-9._:@/+=-]{1,200}")


def logged_request_id(candidate: str | None) -> str:
    """``candidate`` when it is a sane id, else ``-``: what a log line or span may name
    before the request has an id of its own (a client's bytes never split a log line)."""
    return candidate if candidate and _SAFE_REQUEST_ID.fullmatch(candidate) else "-"


def request_id_or_new(*candidates: str | None) -> str:
    """The first sane request id among ``candidates``, else a fresh one."""
    for candidate in candidates:
        if candidate and _SAFE_REQUEST_ID.fullmatch(candidate):
            return candidate
    return new_request_id()


def new_request_id() -> str:
    """A random (version 4) UUID as 32 hex digits, as ``uuid.uuid4().hex`` writes it, built
    without the ``UUID`` object (once per request without an id of its own)."""
    raw = bytearray(os.urandom(16))
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # the RFC 4122 variant
    return raw.hex()
