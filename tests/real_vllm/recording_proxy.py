"""A loopback HTTP proxy in front of a real engine that records when each request came and went.

    with recording_proxy(engine.url) as proxy:       proxy.url: where the sidecar sends legs
        ...                                           proxy.seen(): [Passage(...), ...]

Each ``Passage`` holds the request's path, its ``X-Request-Id``, its status, when the proxy
received the request's head (``arrived``) and when the engine's answer was complete at the
proxy (``answered``), both on this process's monotonic clock, so passages through two
proxies compare. The answer goes through as the engine writes it (a stream stays a stream),
except its last bytes, which wait until the passage is recorded: a caller holding the whole
answer finds its passage in ``seen()``, and never had it before ``answered``.

A client that closes its connection before the answer is whole (the sidecar stopping a
decode leg) closes the proxy's connection to the engine too, as it would have closed the
engine's own (vLLM aborts a request whose client went away); that passage is recorded with
``completed`` False, ``answered`` the time the client left, and the status of the engine's
answer head if one had come (else None). Without this, a leg the sidecar stopped went on in
the engine behind the proxy: a push decode stopped for a stale identity waited there for KV
that never came, and held up the decode engine's next request for about 30 s.

``hold_s`` (default 0) holds each whole answer that long before its last bytes leave, and
``answered`` is then the time they leave: in front of a prefill engine it widens the window in
which a decode leg sent at the same time must reach its engine, so that a machine's
scheduling jitter (a prefill of tens of milliseconds, a loaded machine) cannot reorder the
two, while a sidecar that waits for the prefill's answer still cannot send the decode before
``answered``.

Used to observe, from outside the sidecar, that a decode leg reached the decode engine
before the prefill leg's answer left the prefill engine's proxy.

Deliberate limits: POST and GET only, one upstream, no TLS; the proxy's own hop adds well
under a millisecond on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp
from aiohttp import web

_HOP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})
#: The proxy's one client session to the engine.
_SESSION = web.AppKey("session", aiohttp.ClientSession)


@dataclass(frozen=True)
class Passage:
    path: str
    request_id: str
    arrived: float
    answered: float
    #: The engine's status; None when the client left before the engine's answer head came.
    status: int | None
    #: False when the client left before the answer was whole (the engine's request aborted).
    completed: bool = True


class RecordingProxy:
    def __init__(self, upstream: str, hold_s: float = 0.0) -> None:
        self.upstream = upstream.rstrip("/")
        self.hold_s = hold_s
        self.url = ""
        self._passages: list[Passage] = []
        self._lock = threading.Lock()
        self._recorded = threading.Condition(self._lock)

    def seen(self, path: str | None = None) -> list[Passage]:
        with self._lock:
            return [p for p in self._passages if path is None or p.path == path]

    def passages_of(self, request_id: str, path: str, timeout_s: float) -> list[Passage]:
        """The passages of ``request_id`` on ``path``, once there is one (a held answer, or
        one a stream's client did not wait for, is recorded when it leaves); [] after
        ``timeout_s``."""
        def mine() -> list[Passage]:
            return [p for p in self._passages if p.request_id == request_id and p.path == path]

        with self._recorded:
            self._recorded.wait_for(mine, timeout_s)
            return mine()

    def _record(self, passage: Passage) -> None:
        with self._recorded:
            self._passages.append(passage)
            self._recorded.notify_all()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        request_id = request.headers.get("X-Request-Id", "")
        status: int | None = None
        recorded = False
        try:
            body = await request.read()
            headers = {k: v for k, v in request.headers.items()
                       if k.lower() not in _HOP_HEADERS}
            session = request.app[_SESSION]
            async with session.request(request.method, self.upstream + request.path_qs,
                                       data=body, headers=headers) as upstream:
                status = upstream.status
                response = web.StreamResponse(status=upstream.status)
                for name, value in upstream.headers.items():
                    if name.lower() not in _HOP_HEADERS:
                        response.headers[name] = value
                await response.prepare(request)
                # The last bytes are held back until the passage is recorded: whoever reads
                # the answer cannot have it whole before ``answered``, nor before ``seen()``
                # has it.
                last = b""
                if upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
                    async for chunk in upstream.content.iter_any():
                        if last:
                            await response.write(last)
                        last = chunk
                else:
                    last = await upstream.read()
                if self.hold_s:
                    await asyncio.sleep(self.hold_s)  # a delay injected, not a wait for state
                self._record(Passage(request.path, request_id, arrived, time.monotonic(),
                                     status))
                recorded = True
                if last:
                    await response.write(last)
                await response.write_eof()
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            # The client went away: this handler is cancelled (``handler_cancellation``) or a
            # write fails, and leaving the ``session.request`` block has closed the
            # connection to the engine, which aborts the request there.
            if not recorded:
                self._record(Passage(request.path, request_id, arrived, time.monotonic(),
                                     status, completed=False))
            raise


@contextlib.contextmanager
def recording_proxy(upstream: str, hold_s: float = 0.0) -> Iterator[RecordingProxy]:
    """Run a ``RecordingProxy`` to ``upstream`` on a free loopback port, in its own thread."""
    proxy = RecordingProxy(upstream, hold_s)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    stop: asyncio.Event | None = None

    async def serve() -> None:
        nonlocal stop
        stop = asyncio.Event()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app[_SESSION] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        app.router.add_route("*", "/{tail:.*}", proxy._forward)
        # A client's close cancels its handler, which closes the connection to the engine.
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        proxy.url = f"http://127.0.0.1:{port}"
        started.set()
        try:
            await stop.wait()
        finally:
            await app[_SESSION].close()
            await runner.cleanup()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    if not started.wait(30):
        raise RuntimeError("recording proxy did not start")
    try:
        yield proxy
    finally:
        assert stop is not None
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        if not thread.is_alive():  # else a leg still waits on its engine: the thread is a daemon
            loop.close()
