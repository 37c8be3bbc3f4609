"""A POST that keeps an engine's answer byte for byte, even when the engine cuts it short.

Owns one call, ``post_raw(url, body)``: the status, the content type, the body as text, and
whether the body ended cleanly (a chunked stream that the server aborts mid-way raises
``IncompleteRead`` in ``http.client``; the bytes read until then are kept and
``complete`` is False). ``urllib`` would raise and lose the partial body, which is the very
thing a recording of a mid-stream failure needs.

Deliberate limits: plain HTTP on loopback, one request per connection, no retries.
"""

from __future__ import annotations

import http.client
import json
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RawReply:
    status: int
    content_type: str
    body: str
    complete: bool
    error: str | None = None

    def json(self) -> Any:
        return json.loads(self.body)

    def record(self) -> dict[str, Any]:
        return asdict(self)


def post_raw(url: str, body: dict[str, Any], timeout: float = TIMEOUT_S,
             headers: dict[str, str] | None = None) -> RawReply:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    try:
        conn.request("POST", parts.path, json.dumps(body),
                     {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        pieces: list[bytes] = []
        complete, error = True, None
        try:
            while piece := resp.read1(65536):
                pieces.append(piece)
        except http.client.IncompleteRead as exc:
            pieces.append(exc.partial)
            complete, error = False, f"IncompleteRead: {exc!r}"
        except (ConnectionError, http.client.HTTPException) as exc:
            complete, error = False, f"{type(exc).__name__}: {exc}"
        return RawReply(resp.status, resp.getheader("content-type", ""),
                        b"".join(pieces).decode(errors="replace"), complete, error)
    finally:
        conn.close()


def get_raw(url: str, timeout: float = TIMEOUT_S) -> RawReply:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    try:
        conn.request("GET", parts.path)
        resp = conn.getresponse()
        return RawReply(resp.status, resp.getheader("content-type", ""),
                        resp.read().decode(errors="replace"), True)
    finally:
        conn.close()
