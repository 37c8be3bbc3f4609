"""Every use of aiohttp's private surface, in one place, each with its contract test.

``tests/http/test_aiohttp_private.py`` checks every touch against the installed aiohttp
(pyproject.toml pins the minor versions those tests passed on):

1. ``HeadTimeoutAppRunner``: a deadline for a client's request head. The runner re-classes the
   server ``AppRunner._make_server`` built; its handler times heads by ``RequestHandler._waiter``
   and ``_request_count`` and closes a connection whose head is late.
   The same handler overrides ``RequestHandler.handle_error``, where aiohttp answers what it
   refuses itself (malformed framing, bare CR or LF, obs-fold, a head line over 8 KiB, a
   body whose framing or coding breaks) and a handler's unexpected exception: the answer is
   the taxonomy's JSON (400 ``invalid_request``; 500 ``internal_error``), never aiohttp's
   text/plain echo of the client's bytes, and the connection is closed (aiohttp's own rule:
   after a framing error it cannot be trusted). A refusal logs one line without the client's
   bytes and no traceback, at most one per 10 s per worker (``LogEvery``), so no client can
   flood the log; a handler's exception keeps aiohttp's traceback (a bug of ours).
   A body whose chunked framing breaks while its handler reads it fails that read at once
   (``_current_request``'s content): aiohttp queues the parse error as the next message and
   would leave the read waiting until the body deadline.
   The runner also wraps ``web.Server.request_handler``: a request target that is no path
   (``CONNECT host:port``, ``OPTIONS *``, which aiohttp's router answers with a text/plain 404)
   is refused with 400 ``invalid_request`` JSON before routing.
   And it dispatches the application's plain-path POST routes (the PD routes) itself: one
   dict look-up by the raw path, then the route's handler with the request's ``_match_info``
   set to one frozen ``UrlMappingMatchInfo`` per route, built at start (what
   ``Application._handle`` would build for each request: the same ``request.app`` and
   ``on_response_prepare`` signals), instead of the router's resolve, a new match info and
   ``Application._handle`` for every request. Anything else (another method or path, a path
   with a query or not in its canonical form, an ``Expect`` header, an application with
   middlewares) goes through the application as before.
2. ``StreamWithHead``: a stream's head leaves with its first chunk (``_send_headers_immediately``).
3. ``ClientSocket``: relayed bytes written straight onto the client's transport in aiohttp's
   framing, after aiohttp wrote the head and first chunk; a full socket waits on ``drain``.
4. ``WholeAnswer``: a complete answer (a PD route's JSON, a fan-out's merged JSON, a whole
   stream the prefill answered) whose head and body leave in one write straight onto the
   transport. It sets the headers ``web.Response`` would (``Content-Length``, a default
   ``Content-Type``, ``Date``, ``Server``, the ``Connection`` rule), lets the application's
   ``on_response_prepare`` signals run on them as aiohttp does (``request._prepare_hook``),
   serializes them with aiohttp's own ``_serialize_headers`` and marks itself sent
   (``_eof_sent``, ``_body_length``), so the connection's keep-alive and access log read it
   like any response: the same bytes as ``web.Response``, without its generic machinery
   (content-type and charset arguments, compression, cookies, chunking, the payload writer's
   buffering). Error answers stay ``web.Response``: they also answer ``HEAD`` requests.

Deliberate limits (the head deadline): bytes pipelined while a request is being answered are
not timed; an idle kept-alive connection is left to aiohttp's keep-alive timeout; the TLS
handshake has asyncio's own timeout (60 s). Why each touch:
docs/extending/design-notes.md#aiohttp-private
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

from aiohttp import hdrs, web
from aiohttp.client_exceptions import ClientConnectionResetError
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE, HttpVersion10, HttpVersion11
from aiohttp.http_exceptions import BadHttpMethod, HttpProcessingError, LineTooLong
from aiohttp.http_writer import _serialize_headers
from aiohttp.web_protocol import RequestHandler, RequestPayloadError
from aiohttp.web_urldispatcher import UrlMappingMatchInfo
from multidict import CIMultiDict

from sidecar.errors import InvalidRequest, SidecarError
from sidecar.http_server.errors import error_response
from sidecar.observability.logs import LogEvery

logger = logging.getLogger(__name__)

#: At most one line per this many seconds about requests aiohttp refused itself.
REFUSAL_LOG_INTERVAL_S: Final = 10.0

_Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


def _refusal(exc: BaseException | None) -> InvalidRequest:
    """What the client is told about a request aiohttp refused (never its own bytes)."""
    if isinstance(exc, LineTooLong):
        return InvalidRequest("request line or header field too long (8190 bytes at most)")
    if isinstance(exc, BadHttpMethod):
        return InvalidRequest("malformed request line: not an HTTP/1.x request")
    if isinstance(exc, RequestPayloadError):
        return InvalidRequest("request body framing or content coding is malformed")
    return InvalidRequest("malformed HTTP/1.1 request (framing, line endings or header syntax)")


def _origin_form_only(handler: _Handler) -> _Handler:
    """``handler`` for requests whose target is a path; others refused before routing."""

    async def serve(request: web.BaseRequest) -> web.StreamResponse:
        if request.method == hdrs.METH_CONNECT or not request.raw_path.startswith("/"):
            return error_response(InvalidRequest(
                "the request target must be a path: the sidecar is no proxy (CONNECT) and "
                "answers no server-wide OPTIONS *"))
        return await handler(request)

    return serve


def _direct_posts(app: web.Application, handler: _Handler) -> _Handler:
    """``handler`` (the application's), with the application's plain-path POST routes
    dispatched by their raw path, skipping the router (the module docstring, touch 1)."""
    if app.middlewares:
        return handler
    direct: dict[str, tuple[_Handler, UrlMappingMatchInfo]] = {}
    for resource in app.router.resources():
        if not isinstance(resource, web.PlainResource):
            continue
        for route in resource:
            if route.method == hdrs.METH_POST:
                match_info = UrlMappingMatchInfo({}, route)
                match_info.add_app(app)
                match_info.freeze()
                direct[resource.canonical] = (route.handler, match_info)  # type: ignore[assignment]
    if not direct:
        return handler

    async def dispatch(request: web.BaseRequest) -> web.StreamResponse:
        route = direct.get(request.raw_path) if request.method == hdrs.METH_POST else None
        if route is None or hdrs.EXPECT in request.headers:
            return await handler(request)
        request._match_info = route[1]  # type: ignore[attr-defined]
        return await route[0](request)

    return dispatch


class _HeadTimeoutHandler(RequestHandler):
    """aiohttp's connection protocol, closing a connection whose head is late (no deadline
    when ``head_timeout_s`` is None) and answering aiohttp's own refusals as JSON."""

    __slots__ = ("_head_timeout_s", "_head_timer", "_refusals")

    def __init__(self, manager: web.Server, *, head_timeout_s: float | None,
                 refusals: LogEvery, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._head_timeout_s = head_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._refusals = refusals

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        error: SidecarError
        if status >= 500 and not isinstance(exc, HttpProcessingError | RequestPayloadError):
            # A handler raised: a bug of ours, worth its traceback.
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
            error = SidecarError("internal error")
        else:
            error = _refusal(exc)
            left_out = self._refusals.due()
            if left_out is not None:
                logger.warning("refused a malformed HTTP request from %s (%s)%s",
                               request.remote, type(exc).__name__ if exc else status,
                               f"; {left_out} more since the last such line" if left_out
                               else "")
        if request.writer.output_size > 0:
            # Part of an answer left already: no second status (aiohttp's own rule).
            raise ConnectionError("response already started; cannot send an error response")
        response = error_response(error)
        response.force_close()
        return response

    def log_exception(self, *args: Any, **kw: Any) -> None:
        # aiohttp reads a refused body's rest after the answer (its lingering close) and logs
        # the same broken framing again with a traceback: answered already, say it quietly.
        if isinstance(kw.get("exc_info"), HttpProcessingError | RequestPayloadError):
            logger.debug("connection closed after a malformed request body")
            return
        super().log_exception(*args, **kw)

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
            self._fail_unfinished_body()
        elif awaiting_head and self._head_timer is None:
            self._arm()

    def _fail_unfinished_body(self) -> None:
        # A new message while the request being handled still reads its body can only be
        # aiohttp's parse error in that body's framing (a bad chunk size): aiohttp queues
        # it as the next message and leaves the body waiting for bytes that never come.
        current = self._current_request
        if current is not None and not current.content.is_eof():
            current.content.set_exception(RequestPayloadError("malformed chunked framing"))

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._head_timeout_s is not None:
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

    head_timeout_s: float | None
    refusals: LogEvery

    def __call__(self) -> RequestHandler:
        return _HeadTimeoutHandler(self, loop=self._loop, head_timeout_s=self.head_timeout_s,
                                   refusals=self.refusals, **self._kwargs)


class HeadTimeoutAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections are closed when a request head is late (None: no
    head deadline), whose refusals are JSON and whose request targets are paths."""

    __slots__ = ("_head_timeout_s",)

    def __init__(self, app: web.Application, *, head_timeout_s: float | None,
                 **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._head_timeout_s = head_timeout_s

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # Re-class, not rebuild: only aiohttp's factory assembles the handler arguments.
        server.__class__ = _HeadTimeoutServer
        assert isinstance(server, _HeadTimeoutServer)
        server.head_timeout_s = self._head_timeout_s
        server.refusals = LogEvery(REFUSAL_LOG_INTERVAL_S)
        server.request_handler = _origin_form_only(
            _direct_posts(self.app, server.request_handler))
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

    def send(self, data: bytes) -> bool | None:
        """Write ``data`` as the response's next piece: True while the socket takes more,
        False once it is full, None (nothing written) when the client has gone. One call per
        relayed read: this runs once per token at an engine's pace."""
        transport = self._protocol.transport
        if transport is None or transport.is_closing():
            return None
        transport.write(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)
        return transport.get_write_buffer_size() <= SOCKET_HIGH_WATER

    async def drain(self) -> None:
        """Wait until the socket takes more (aiohttp's flow control)."""
        await self._writer.drain()


#: Bodies at least this long go out beside their head (``writelines``) rather than copied
#: behind it: aiohttp's own threshold (``MIN_PAYLOAD_FOR_WRITELINES``).
_JOIN_BELOW: Final = 2048


class WholeAnswer(web.StreamResponse):
    """A complete answer, head and body in one write (the module docstring, touch 4).

    For answers with a body to a request that may have one (a PD route's POST): no ``HEAD``,
    no 1xx, 204 or 304, whose heads aiohttp writes differently.
    """

    def __init__(self, body: bytes, headers: CIMultiDict[str], status: int = 200) -> None:
        super().__init__(status=status, _real_headers=headers)
        self._whole = body

    async def prepare(self, request: web.BaseRequest) -> None:
        if self._eof_sent:
            return
        body = self._whole
        headers = self._headers
        keep_alive = self._keep_alive
        if keep_alive is None:
            keep_alive = self._keep_alive = request.keep_alive
        headers[hdrs.CONTENT_LENGTH] = str(len(body))
        if hdrs.CONTENT_TYPE not in headers:
            headers[hdrs.CONTENT_TYPE] = "application/octet-stream"
        if hdrs.DATE not in headers:
            headers[hdrs.DATE] = rfc822_formatted_time()
        if hdrs.SERVER not in headers:
            headers[hdrs.SERVER] = SERVER_SOFTWARE
        version = request.version
        if hdrs.CONNECTION not in headers:
            if keep_alive:
                if version == HttpVersion10:
                    headers[hdrs.CONNECTION] = "keep-alive"
            elif version == HttpVersion11:
                headers[hdrs.CONNECTION] = "close"
        self._req = request
        await request._prepare_hook(self)
        head = _serialize_headers(
            f"HTTP/{version[0]}.{version[1]} {self._status} {self._reason}", headers)
        transport = request.protocol.transport
        if transport is None or transport.is_closing():
            raise ClientConnectionResetError("Cannot write to closing transport")
        if len(body) < _JOIN_BELOW:
            transport.write(head + body)
        else:
            transport.writelines((head, body))
        self._eof_sent = True
        self._req = None
        self._body_length = len(head) + len(body)

    async def write_eof(self, data: bytes = b"") -> None:
        return  # prepare() wrote it all
