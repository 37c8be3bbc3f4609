"""Every use of aiohttp's private surface, in one place, each with its contract test.

``tests/http/test_aiohttp_private.py`` checks every touch against the installed aiohttp
(pyproject.toml pins the minor versions those tests passed on):

1. ``HeadTimeoutAppRunner``: a deadline for a client's request head. The runner re-classes the
   server ``AppRunner._make_server`` built; its handler times heads by ``RequestHandler._waiter``
   and ``_request_count`` and closes a connection whose head is late.
2. ``StreamWithHead``: a stream's head leaves with its first chunk (``_send_headers_immediately``).
3. ``ClientSocket``: relayed bytes written straight onto the client's transport in aiohttp's
   framing, after aiohttp wrote the head and first chunk; a full socket waits on ``drain``.

Deliberate limits (the head deadline): bytes pipelined while a request is being answered are
not timed; an idle kept-alive connection is left to aiohttp's keep-alive timeout; the TLS
handshake has asyncio's own timeout (60 s). Why each touch:
docs/extending/design-notes.md#aiohttp-private
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Final

from aiohttp import hdrs, web
from aiohttp.web_protocol import RequestHandler

logger = logging.getLogger(__name__)


class _HeadTimeoutHandler(RequestHandler):
    """aiohttp's connection protocol, closing a connection whose head is late."""

    __slots__ = ("_head_timeout_s", "_head_timer")

    def __init__(self, manager: web.Server, *, head_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._head_timeout_s = head_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()  # a client that connects and sends nothing is late too

    def data_received(self, data: bytes) -> None:
        # ``_waiter`` is set while waiting for the next request: bytes then start a head.
        awaiting_head = self._waiter is not None
        heads_before = self._request_count
        super().data_received(data)
        if self._request_count != heads_before:
            self._disarm()
        elif awaiting_head and self._head_timer is None:
            self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._head_timer = self._loop.call_later(self._head_timeout_s, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        logger.debug("closing a connection whose request head took over %g s",
                     self._head_timeout_s)
        self.force_close()


class _HeadTimeoutServer(web.Server):
    """``web.Server`` whose connections time their request heads."""

    head_timeout_s: float

    def __call__(self) -> RequestHandler:
        return _HeadTimeoutHandler(self, loop=self._loop, head_timeout_s=self.head_timeout_s,
                                   **self._kwargs)


class HeadTimeoutAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections are closed when a request head is late."""

    __slots__ = ("_head_timeout_s",)

    def __init__(self, app: web.Application, *, head_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._head_timeout_s = head_timeout_s

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # Re-class, not rebuild: only aiohttp's factory assembles the handler arguments.
        server.__class__ = _HeadTimeoutServer
        assert isinstance(server, _HeadTimeoutServer)
        server.head_timeout_s = self._head_timeout_s
        return server


class StreamWithHead(web.StreamResponse):
    """A stream whose head leaves with its first chunk (as ``web.Response`` does): one send."""

    _send_headers_immediately = False


#: Unsent bytes above which a relay stops reading its engine: asyncio's and uvloop's default
#: write high-water mark, where aiohttp's protocol pauses writing.
SOCKET_HIGH_WATER: Final = 64 * 1024


class ClientSocket:
    """The client's transport of a prepared stream, written to without aiohttp's writer."""

    __slots__ = ("_chunked", "_protocol", "_writer")

    def __init__(self, request: web.BaseRequest, response: web.StreamResponse) -> None:
        # What prepare() chose: chunks for HTTP/1.1, bare bytes to the close for HTTP/1.0.
        self._chunked = response.headers.get(hdrs.TRANSFER_ENCODING, "").lower() == "chunked"
        self._protocol = request.protocol
        self._writer = request.writer

    def open(self) -> asyncio.Transport | None:
        """The transport while the client is still there, else None."""
        transport = self._protocol.transport
        if transport is None or transport.is_closing():
            return None
        return transport

    def write(self, transport: asyncio.Transport, data: bytes) -> bool:
        """Write ``data`` as the response's next piece; False once the socket is full."""
        transport.write(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)
        return transport.get_write_buffer_size() <= SOCKET_HIGH_WATER

    async def drain(self) -> None:
        """Wait until the socket takes more (aiohttp's flow control)."""
        await self._writer.drain()
