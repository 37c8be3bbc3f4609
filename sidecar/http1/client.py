"""The pooled upstream HTTP/1.1 client: one per process, shared by every engine call.

    client.request("POST", url, headers, body) ─▶ UpstreamResponse (head arrived)
        ├── idle connection for (scheme, host, port, TLS name)?  reuse it (LIFO: the warmest)
        └── else open one (connect deadline), within the global connection limit

Pool rules, and why: idle connections are dropped after ``keepalive_s``, which is set below
the engines' own idle timeout (vLLM/uvicorn: 5 s) so the sidecar never writes into a
connection the engine is closing; a request never retries on another connection (an engine
may already have started a prefill; doubling it is worse than one 502); at the connection
limit callers wait for a slot in arrival order. Connections go where the URL says: callers
pass the address they checked (see ``sidecar.targets.selector``), no proxy, no redirect, no
cookie, no decompression.

TLS: an ``https`` URL is always TLS (never a plain-TCP fallback), verified by the one context
given (its CA and, for mutual TLS, its client certificate) or the system store. The name
verified is the URL's host, or ``server_hostname`` when the caller connects to an address it
resolved itself (a prefill pool entry named by DNS): the connection goes to the checked
address and the certificate must still carry the configured name. Connections verified for
different names are never shared.

A request on the wire: its target (``target_of``: pool key, address, TLS name, Host header,
request target) is parsed once per URL (cached: the engines' URLs repeat; one whose path
carries an id, new per call, caches only its origin's parse and cuts its request target off
the string, the cut urlsplit makes, which a property test holds to the same answer), and its
head is written by ``encode_head``; header names and values are checked for line breaks and
NUL, so no caller-supplied string can write a header of its own.

Deliberate limits: HTTP/1.1 only; request bodies are bytes or an async iterable of bytes
(streamed with ``Content-Length`` when given, else chunked); TLS uses the one context given.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import functools
import os
import socket
import ssl
from collections.abc import AsyncIterable, Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from sidecar.http1.connection import Connection, UpstreamResponse, expire_future
from sidecar.http1.errors import (
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamError,
    UpstreamTLSError,
)
from sidecar.protocol.context import DEFAULT_PORTS, url_port

Headers = Mapping[str, str] | Iterable[tuple[str, str]]
Body = bytes | AsyncIterable[bytes] | None

#: Which pooled connections can serve a request: scheme, host, port and the TLS name the
#: peer's certificate was verified for ("" for plain HTTP).
PoolKey = tuple[str, str, int, str]


@dataclass(frozen=True, slots=True)
class Target:
    """Where a URL's requests go, and what their request line and Host header say."""

    key: PoolKey
    host: str
    port: int
    #: The name the server's certificate must carry; None for plain HTTP.
    tls_name: str | None
    host_header: str
    path: str


@functools.lru_cache(maxsize=4096)
def target_of(url: str, server_hostname: str | None = None) -> Target:
    """Where ``url`` goes and what its request line names (see the module's docstring)."""
    cut = split_origin(url)
    if cut is None:
        return parse_url(url, server_hostname)
    origin, path = cut
    try:
        base = _origin_target(origin, server_hostname)
    except (UpstreamError, ValueError):
        return parse_url(url, server_hostname)  # the error, naming the whole URL
    return Target(base.key, base.host, base.port, base.tls_name, base.host_header, path)


def split_origin(url: str) -> tuple[str, str] | None:
    """``url`` as its ``scheme://authority`` and its request target (path and query, the
    fragment dropped); None when it has no path or holds anything unprintable (urlsplit
    removes tabs and line breaks: the full parse decides those)."""
    start = url.find("://") + 3
    end = url.find("/", start)
    # The authority ends at the first "/", "?" or "#": without a "/" first, parse it whole.
    if start < 4 or end < 0 or url.find("?", start, end) >= 0 or url.find("#", start, end) >= 0:
        return None
    if not url.isprintable():
        return None
    rest = url[end:]
    if "#" in rest:
        rest = rest.partition("#")[0]
    if "?" in rest:
        path, _, query = rest.partition("?")
        rest = f"{path}?{query}" if query else path
    return url[:end], rest


@functools.lru_cache(maxsize=1024)
def _origin_target(origin: str, server_hostname: str | None) -> Target:
    return parse_url(origin, server_hostname)


def parse_url(url: str, server_hostname: str | None) -> Target:
    """The whole parse of ``url`` (urlsplit); UpstreamError when it is no http(s) URL."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS or not parts.hostname:
        raise UpstreamError(f"unsupported upstream URL {url!r}")
    host = parts.hostname
    port = url_port(parts)
    shown = f"[{host}]" if ":" in host else host
    host_header = shown if port == DEFAULT_PORTS[scheme] else f"{shown}:{port}"
    path = parts.path or "/"
    if parts.query:
        path = f"{path}?{parts.query}"
    tls_name = (server_hostname or host) if scheme == "https" else None
    key = (scheme, host, port, tls_name or "")
    return Target(key, host, port, tls_name, host_header, path)


def encode_head(method: str, target: Target, headers: Headers, framing: str) -> bytes:
    """The request line and headers; ``framing`` is the body's length header line (or "")."""
    lines = [f"{name}: {value}\r\n" for name, value in
             (headers.items() if isinstance(headers, Mapping) else headers)]
    block = "".join(lines)
    # Header injection: each line adds exactly one CR and one LF; a CR, LF or NUL inside a
    # name or value would let a caller-supplied string write headers of its own.
    if block.count("\n") != len(lines) or block.count("\r") != len(lines) or "\0" in block:
        raise UpstreamError("header name or value contains a line break or NUL")
    head = (f"{method} {target.path} HTTP/1.1\r\nHost: {target.host_header}\r\n"
            f"{block}{framing}\r\n")
    return head.encode("utf-8", "surrogateescape")


def framing(method: str, body: Body, content_length: int | None) -> str:
    """The body's length header line: its size, chunked for a stream of unknown size, or none."""
    if isinstance(body, bytes):
        return f"Content-Length: {len(body)}\r\n"
    if body is None:
        return "Content-Length: 0\r\n" if method in ("POST", "PUT", "PATCH") else ""
    if content_length is None:
        return "Transfer-Encoding: chunked\r\n"
    return f"Content-Length: {content_length}\r\n"


#: Bodies up to this size are joined with their head and sent in one write.
_COPY_LIMIT = 64 * 1024


#: OpenSSL's reasons when the peer answered the handshake with something that is not TLS.
_NOT_TLS_REASONS = frozenset({"WRONG_VERSION_NUMBER", "HTTP_REQUEST", "PACKET_LENGTH_TOO_LONG",
                              "RECORD_LAYER_FAILURE", "UNEXPECTED_EOF_WHILE_READING"})


def _tls_reason(exc: ssl.SSLError) -> str:
    """A failed handshake in words: the verification error, or what the peer did instead."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {exc.verify_message or exc.reason}"
    reason = exc.reason or ""
    words = reason.replace("_", " ").lower() if reason else str(exc)
    if reason in _NOT_TLS_REASONS or isinstance(exc, ssl.SSLEOFError):
        return f"{words} (does it serve TLS on this port?)"
    return words


def _connect_reason(exc: OSError) -> str:
    if exc.errno:
        return os.strerror(exc.errno).lower()
    return str(exc) or "connection failed"


class EngineClient:
    """Pooled keep-alive connections to engines; create it inside the running loop."""

    def __init__(
        self,
        *,
        limit: int,
        keepalive_s: float,
        connect_timeout_s: float,
        read_timeout_s: float | None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._limit = limit
        self._keepalive_s = keepalive_s
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._ssl = ssl_context
        self._idle: dict[PoolKey, list[Connection]] = {}
        self._open = 0
        self._slot_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def connect_timeout_s(self) -> float:
        """How long a connect may take before the peer counts as unreachable."""
        return self._connect_timeout_s

    @property
    def open_connections(self) -> int:
        """Connections open now (idle or busy): what the limit counts."""
        return self._open

    async def request(
        self,
        method: str,
        url: str,
        *,
        headers: Headers = (),
        body: Body = None,
        content_length: int | None = None,
        timeout_s: float | None = None,
        server_hostname: str | None = None,
        read_timeout_s: float | None = None,
    ) -> UpstreamResponse:
        """Send one request and return once the response head arrived.

        The caller reads the body and then calls ``release()`` (or uses ``async with``), or
        ``close()`` to drop the connection (an engine call abandoned mid-answer).
        ``timeout_s`` bounds the whole exchange (waiting for a slot, connecting, the head and
        every body read): ``TimeoutError`` past it. It costs one timer per wait instead of
        an ``asyncio.timeout`` scope around the call. ``server_hostname``: for an https URL
        naming an address, the name its certificate must carry (default: the URL's host).
        ``read_timeout_s``: each wait for bytes of this exchange (the head's counted from the
        request's start, after the connect), instead of the client's read timeout.
        """
        target = target_of(url, server_hostname)
        head = encode_head(method, target, headers, framing(method, body, content_length))
        deadline = None if timeout_s is None else self._loop.time() + timeout_s
        # A warm idle connection is the usual case: taken without a coroutine of its own.
        conn = self._take_idle(target.key) or await self._acquire(target, deadline)
        conn.start(method == "HEAD",
                   self._read_timeout_s if read_timeout_s is None else read_timeout_s, deadline)
        try:
            transport = conn.transport
            if transport is None or conn.closed:
                raise UpstreamBroken("connection closed before the request was sent")
            if isinstance(body, bytes):
                if len(body) > _COPY_LIMIT:
                    transport.writelines((head, body))
                else:
                    transport.write(head + body)  # one syscall; the copy is cheaper
            else:
                transport.write(head)
                if body is not None:
                    await self._stream_body(conn, body, chunked=content_length is None)
            await conn.wait_head()
        except BaseException:
            conn.close()
            self._release(conn)
            raise
        return UpstreamResponse(conn, self._release)

    async def get(self, url: str, *, headers: Headers = ()) -> UpstreamResponse:
        return await self.request("GET", url, headers=headers)

    async def close(self) -> None:
        """Close every idle connection and refuse new requests (busy ones end with theirs)."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_exception(UpstreamConnectError("client closed"))

    # ---- the pool ------------------------------------------------------------------------

    def _take_idle(self, key: PoolKey) -> Connection | None:
        """The warmest idle connection for ``key`` still fresh (stale ones closed), or None."""
        idle = self._idle.get(key)
        if idle and not self._closed:
            stale_before = self._loop.time() - self._keepalive_s
            while idle:
                conn = idle.pop()
                if not conn.closed and conn.idle_since > stale_before:
                    return conn
                conn.close()
        return None

    async def _acquire(self, target: Target, deadline: float | None) -> Connection:
        while True:
            if self._closed:
                raise UpstreamConnectError("client closed")
            conn = self._take_idle(target.key)
            if conn is not None:
                return conn
            if self._open < self._limit or self._drop_oldest_idle():
                return await self._connect(target, deadline)
            waiter = self._loop.create_future()
            self._slot_waiters.append(waiter)
            timer = None
            if deadline is not None:
                timer = self._loop.call_at(deadline, expire_future, waiter)
            try:
                await waiter
            except BaseException:
                # Woken for a free slot but leaving anyway (cancelled): the slot is not ours
                # to keep, so the next waiter gets the wake-up instead of waiting for ever.
                if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                    self._wake_one()
                raise
            finally:
                if timer is not None:
                    timer.cancel()
                if not waiter.done():
                    waiter.cancel()

    def _drop_oldest_idle(self) -> bool:
        """Make room at the limit by closing the longest-idle connection of any target."""
        oldest: Connection | None = None
        for idle in self._idle.values():
            if idle and (oldest is None or idle[0].idle_since < oldest.idle_since):
                oldest = idle[0]
        if oldest is None:
            return False
        self._idle[oldest.key].remove(oldest)
        oldest.close()
        self._forget(oldest)  # its slot is free now, not when connection_lost comes
        return True

    def _tls_context(self) -> ssl.SSLContext:
        # Made on the first https engine only: loading the system CA store costs start-up
        # time that a pod of plain-HTTP engines (the usual case) should not pay.
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    async def _connect(self, target: Target, deadline: float | None) -> Connection:
        self._open += 1
        timeout = self._connect_timeout_s
        # Which bound ends a connect that does not complete: the connect timeout (the peer is
        # unreachable: it never saw the request) or the caller's deadline (TimeoutError).
        own_timeout = True
        if deadline is not None and deadline - self._loop.time() < timeout:
            timeout = max(deadline - self._loop.time(), 0.0)
            own_timeout = False
        try:
            async with asyncio.timeout(timeout):
                _, conn = await self._loop.create_connection(
                    lambda: Connection(target.key, self._loop, self._on_lost),
                    target.host,
                    target.port,
                    ssl=self._tls_context() if target.tls_name is not None else None,
                    server_hostname=target.tls_name,
                )
        except TimeoutError:
            self._free_slot()
            if not own_timeout:
                raise
            reason = f"no connection within {timeout:g} s"
            raise UpstreamConnectTimeout(f"cannot connect to {target.host_header}: {reason}",
                                         reason=reason) from None
        except ssl.SSLError as exc:  # an OSError too: the handshake, not the connect, failed
            self._free_slot()
            reason = _tls_reason(exc)
            raise UpstreamTLSError(
                f"TLS handshake with {target.host_header} (name {target.tls_name}) failed: "
                f"{reason}", reason=reason) from None
        except OSError as exc:
            self._free_slot()
            reason = _connect_reason(exc)
            raise UpstreamConnectError(f"cannot connect to {target.host_header}: {reason}",
                                       reason=reason,
                                       refused=exc.errno == errno.ECONNREFUSED) from None
        except BaseException:
            self._free_slot()
            raise
        sock = conn.transport.get_extra_info("socket") if conn.transport else None
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _release(self, conn: Connection) -> None:
        if conn.finish() and not self._closed:
            self._idle.setdefault(conn.key, []).append(conn)
            if self._sweeper is None:
                self._sweeper = self._loop.call_later(self._keepalive_s, self._sweep)
            self._wake_one()
        else:
            conn.close()

    def _on_lost(self, conn: Connection) -> None:
        self._forget(conn)

    def _forget(self, conn: Connection) -> None:
        """Free ``conn``'s slot once, whichever of close-for-room or connection_lost is first."""
        if conn.holds_slot:
            conn.holds_slot = False
            self._free_slot()

    def _free_slot(self) -> None:
        self._open -= 1
        self._wake_one()

    def _wake_one(self) -> None:
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _sweep(self) -> None:
        """Close connections idle past the keep-alive (they hold engine-side resources)."""
        self._sweeper = None
        stale_before = self._loop.time() - self._keepalive_s
        remaining = False
        for idle in self._idle.values():
            keep = [conn for conn in idle if not conn.closed and conn.idle_since > stale_before]
            for conn in idle:
                if conn not in keep:
                    conn.close()
            idle[:] = keep
            remaining = remaining or bool(keep)
        # Prefill targets come and go (pods): forget the ones with nothing pooled.
        for key in [key for key, idle in self._idle.items() if not idle]:
            del self._idle[key]
        if remaining and not self._closed:
            self._sweeper = self._loop.call_later(self._keepalive_s / 2, self._sweep)

    async def _stream_body(
        self, conn: Connection, body: AsyncIterable[bytes], *, chunked: bool
    ) -> None:
        transport = conn.transport
        assert transport is not None
        async for chunk in body:
            if not chunk:
                continue
            if conn.closed:
                raise UpstreamBroken("engine closed the connection while the body was sent")
            if chunked:
                transport.writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))
            else:
                transport.write(chunk)
            await conn.drain()
        if chunked:
            transport.write(b"0\r\n\r\n")
