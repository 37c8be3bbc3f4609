"""The sidecar's HTTP/1.1 client on llhttp (``httptools``): every engine call goes through it.

    client.py      EngineClient: the pooled upstream client of the sidecar's engine calls, and
                   a request on the wire (its target, parsed once per URL, and head bytes)
    connection.py  one pooled connection: socket, parser, flow control, its read and
                   whole-exchange deadlines (one lazily re-armed timer), and
                   UpstreamResponse, the reader's side of an exchange (readany, pipe, release)
    errors.py      what can go wrong upstream, as callers tell it apart

The bench's stub engines serve on the same llhttp stack (``sidecar.tools.stubs.lean``); the
sidecar itself serves with aiohttp.
"""

from sidecar.http1.client import EngineClient
from sidecar.http1.connection import UpstreamResponse
from sidecar.http1.errors import (
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTLSError,
)

__all__ = [
    "EngineClient",
    "UpstreamBroken",
    "UpstreamConnectError",
    "UpstreamConnectTimeout",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamResponse",
    "UpstreamTLSError",
]
