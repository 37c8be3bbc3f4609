"""The request id: one header name, one rule for which client-given ids are kept.

    X-Request-Id: <id>  ─request_id_or_new()─▶ the id when sane, else a fresh uuid4 hex

The same id rides on both engine legs, comes back to the client and names the request in
logs (over gRPC the messages' ``request_id``). A sane id is 1-200 characters of
``[A-Za-z0-9._:@/+=-]``: it can never inject a header or a log line.
"""

from __future__ import annotations

import os
import re
from typing import Final

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
