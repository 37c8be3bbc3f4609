"""A deadline for a client's request head on the aiohttp front door (slow-header clients).

    HeadTimeoutAppRunner(app, head_timeout_s=10) ─▶ web.Server whose connections are
    _HeadTimeoutHandler: a timer armed on connection_made and when a kept-alive, idle
    connection receives the first bytes of its next request that do not complete a head;
    cancelled when a head is parsed; when it fires the connection is closed.

aiohttp bounds the size of a head but not the time it takes to arrive, so a client that
sends a head a byte at a time (or connects and sends nothing) holds a socket for as long as
the keep-alive timeout allows. Such connections never reach a handler (no admission slot),
but they hold file descriptors; this closes them. Requests whose head arrives in one read,
the usual case, never arm a timer on kept-alive connections.

aiohttp has no hook for this: ``web.Server`` builds ``RequestHandler`` directly, so the
runner re-classes the server it built (keeping every handler argument the application set)
to one that builds the subclass below. The subclass reads two attributes of aiohttp's
``RequestHandler`` (``_waiter``: the handler waits for the next request; ``_request_count``:
heads parsed); ``tests/security/test_slow_headers.py`` breaks if a new aiohttp changes them.

Deliberate limits: the bytes of a next request that a client pipelines while its current
one is still being answered are not timed (they are told from a body only once the handler
waits for a new head; a timer starts then if more bytes arrive); a connection that stays
idle between requests is left to aiohttp's keep-alive timeout; the TLS handshake has
asyncio's own timeout (60 s) and ``connection_made`` comes after it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
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
