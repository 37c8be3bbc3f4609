"""Every use of aiohttp's private surface, in one place, each with its contract test.

aiohttp offers no public hook for three things the front door needs; each is done here, and
``tests/http_server/test_aiohttp_private.py`` checks every touch against the installed
aiohttp (pyproject.toml pins the minor versions those tests passed on):

1. **A deadline for a client's request head** (``HeadTimeoutAppRunner``). aiohttp bounds the
   size of a head but not the time it takes to arrive, so a client that sends a head a byte at
   a time (or connects and sends nothing) holds a socket for as long as the keep-alive
   timeout allows. ``web.Server`` builds ``RequestHandler`` directly, so the runner re-classes
   the server it built (``AppRunner._make_server``; the server's ``_kwargs`` and ``_loop``
   rebuild the handler with every argument the application set) to one that builds the
   subclass below, which reads two attributes of ``RequestHandler``: ``_waiter`` (set while
   the handler waits for the next request) and ``_request_count`` (heads parsed).
   A timer is armed on ``connection_made`` and when a kept-alive, idle connection receives
   bytes that do not complete a head; cancelled when a head is parsed; when it fires the
   connection is closed. Requests whose head arrives in one read never arm a timer on
   kept-alive connections.
2. **A stream's head leaving with its first chunk** (``StreamWithHead``): the private class
   attribute ``_send_headers_immediately``, which aiohttp's own ``web.Response`` sets; one
   send instead of two.
3. **Relayed bytes written straight onto the client's transport** (``ClientSocket``): the
   streamed relay writes each read's bytes from the upstream connection's read callback, in
   the framing aiohttp's ``StreamWriter`` uses (HTTP/1.1 chunks ``%x\r\n...\r\n``; an
   HTTP/1.0 client gets the bare bytes), after aiohttp has written the head and the first
   chunk (its writer then holds nothing back), and waits out a full socket with the writer's
   ``drain``.

Deliberate limits (the head deadline): the bytes of a next request that a client pipelines
while its current one is still being answered are not timed (they are told from a body only
once the handler waits for a new head; a timer starts then if more bytes arrive); a
connection that stays idle between requests is left to aiohttp's keep-alive timeout; the TLS
handshake has asyncio's own timeout (60 s) and ``connection_made`` comes after it.
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
        # ``_waiter`` is set while the handler waits for the next request: bytes arriving
        # then start a head (bytes arriving while it is handling one are its body).
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
        # Re-class rather than rebuild: the server carries the application's handler
        # arguments, which only aiohttp's own factory knows how to assemble.
        server.__class__ = _HeadTimeoutServer
        assert isinstance(server, _HeadTimeoutServer)
        server.head_timeout_s = self._head_timeout_s
        return server


class StreamWithHead(web.StreamResponse):
    """A stream whose head leaves with its first chunk: one send instead of two.

    aiohttp's own ``web.Response`` buffers its head this way; a ``StreamResponse`` sends it at
    ``prepare()`` unless told otherwise.
    """

    _send_headers_immediately = False


#: Unsent bytes above which a relay stops reading its engine: asyncio's and uvloop's default
#: write high-water mark, where aiohttp's protocol pauses writing.
SOCKET_HIGH_WATER: Final = 64 * 1024


class ClientSocket:
    """The client's transport of a prepared stream, written to without aiohttp's writer."""

    __slots__ = ("_chunked", "_protocol", "_writer")

    def __init__(self, request: web.BaseRequest, response: web.StreamResponse) -> None:
        # What aiohttp's prepare() chose: chunks for HTTP/1.1, the bare bytes until the
        # connection closes for an HTTP/1.0 client.
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
