"""The request id: one header name, one rule for which client-given ids are kept.

    X-Request-Id: <id>  ─request_id_or_new()─▶ the id when sane, else a fresh uuid4 hex

The same id rides on both engine legs, comes back to the client and names the request in
logs (over gRPC the messages' ``request_id``). A sane id is 1-200 characters of
``[A-Za-z0-9._:@/+=-]``: it can never inject a header or a log line.
"""

from __future__ import annotations

import re
import uuid
from typing import Final

REQUEST_ID_HEADER: Final = "X-Request-Id"

_SAFE_REQUEST_ID: Final = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,200}$")


def request_id_or_new(*candidates: str | None) -> str:
    """The first sane request id among ``candidates``, else a fresh one."""
    for candidate in candidates:
        if candidate and _SAFE_REQUEST_ID.match(candidate):
            return candidate
    return uuid.uuid4().hex
