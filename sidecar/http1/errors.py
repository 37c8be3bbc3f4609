"""What can go wrong on an upstream HTTP/1.1 exchange, as the callers need to tell it apart.

    UpstreamError
    ├── UpstreamConnectError   no connection (refused, unreachable, TLS handshake failed)
    ├── UpstreamBroken         the connection ended before the response did
    └── UpstreamProtocolError  the bytes are not HTTP/1.1 (or not what was asked for)

Deadlines are the builtin ``TimeoutError`` (connect and per-read), as ``asyncio.timeout``
raises it, so one ``except TimeoutError`` covers both the client's and the caller's.
"""

from __future__ import annotations


class UpstreamError(Exception):
    """Base of every upstream failure that is not a deadline."""


class UpstreamConnectError(UpstreamError):
    """The connection could not be opened."""


class UpstreamBroken(UpstreamError):
    """The peer closed or reset the connection before the response was complete."""


class UpstreamProtocolError(UpstreamError):
    """The peer's bytes are not a valid HTTP/1.1 response."""
