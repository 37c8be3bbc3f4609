"""What can go wrong on an upstream HTTP/1.1 exchange, as the callers need to tell it apart.

    UpstreamError
    ├── UpstreamConnectError   no connection (refused, unreachable)
    │   ├── UpstreamConnectTimeout  the connection was not accepted in time (SYN dropped)
    │   └── UpstreamTLSError        TCP connected, the TLS handshake failed (verification,
    │                               or a peer that speaks no TLS)
    ├── UpstreamBroken         the connection ended before the response did
    └── UpstreamProtocolError  the bytes are not HTTP/1.1 (or not what was asked for)

Each carries ``reason``: what happened, in words (no exception class), for the callers'
messages. Deadlines are the builtin ``TimeoutError`` (the caller's whole-exchange deadline
and per-read), as ``asyncio.timeout`` raises it, so one ``except TimeoutError`` covers both
the client's and the caller's; a connect that fails its own connect timeout is
``UpstreamConnectTimeout`` instead: the peer never saw the request.
"""

from __future__ import annotations


class UpstreamError(Exception):
    """Base of every upstream failure that is not a deadline."""

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        #: What happened, in words, without the address (the caller names the peer).
        self.reason = reason if reason is not None else message


class UpstreamConnectError(UpstreamError):
    """The connection could not be opened."""

    def __init__(self, message: str, *, reason: str | None = None, refused: bool = False) -> None:
        super().__init__(message, reason=reason)
        #: The peer actively refused it (nothing listens there).
        self.refused = refused


class UpstreamConnectTimeout(UpstreamConnectError):
    """The connection was not accepted within the connect timeout."""


class UpstreamTLSError(UpstreamConnectError):
    """The TLS handshake failed: the peer's certificate did not verify, or it spoke no TLS."""


class UpstreamBroken(UpstreamError):
    """The peer closed or reset the connection before the response was complete."""


class UpstreamProtocolError(UpstreamError):
    """The peer's bytes are not a valid HTTP/1.1 response."""
