"""The lean vLLM decode's NIXL pull: ``GET /_stub/nixl/<request id>`` on the hand-off's
``remote_host:remote_port``, pipelined on one keep-alive connection per prefill.

    Puller.pull(target, done) ─▶ done((status, parsed JSON or None))  or  done(None)
                                 (nothing answered: unreachable, closed, or past the timeout)

What the answer means is ``handoff.judge_nixl_pull``'s business, the same for both
transports; this module only carries the bytes, as cheaply as the bench needs: no task, no
future and no timer per pull (a callback when the answer is parsed; one sweep a second fails
pulls older than the timeout), requests pipelined in order on one connection per prefill
(the lean server answers pipelined requests in order). A connection idle for 4 s is not
reused (the server closes idle ones after 5 s), so a pull never races that close.

Deliberate limits: plain http, no retry (a failed pull is the verdict ``pull_failed``); a
pull past its timeout fails every pull queued behind it on that connection (pipelining
cannot skip one).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final, cast

import httptools
import orjson

from sidecar.tools.stubs.handoff import PullTarget, url_host

logger = logging.getLogger(__name__)

Pulled = tuple[int, Any] | None
Done = Callable[[Pulled], None]

_IDLE_S: Final = 4.0
_MAX_BODY: Final = 1 << 20


class _Channel(asyncio.Protocol):
    """One connection to one prefill; answers come back in the order pulls went out."""

    def __init__(self, host_header: bytes) -> None:
        self.host_header = host_header
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.pending: deque[tuple[Done, float]] = deque()
        self.unsent: list[bytes] = []
        self.closed = False
        self.idle_since = time.monotonic()
        self._body: list[bytes] = []
        self._size = 0

    # -- transport callbacks ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses but have its methods.
        self.transport = cast(asyncio.Transport, transport)
        if self.closed:  # failed (timed out, puller closed) while connecting
            self.transport.close()
            return
        if self.unsent:
            self.transport.write(b"".join(self.unsent))
            self.unsent.clear()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.fail()

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail()

    # -- parser callbacks -------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._body = []
        self._size = 0

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > _MAX_BODY:
            raise httptools.HttpParserError("pull answer too large")
        self._body.append(body)

    def on_message_complete(self) -> None:
        if not self.pending:
            self.fail()  # an answer nobody asked for: the stream is out of step
            return
        done, _ = self.pending.popleft()
        status = self.parser.get_status_code()
        if not self.pending:
            self.idle_since = time.monotonic()
        try:
            data = orjson.loads(b"".join(self._body)) if status == 200 else None
        except orjson.JSONDecodeError:
            data = None
        _call(done, (status, data))

    # -- the puller's side ------------------------------------------------------------

    def send(self, path: str, done: Done, deadline: float) -> None:
        self.pending.append((done, deadline))
        request = b"GET %s HTTP/1.1\r\n%s\r\n" % (path.encode(), self.host_header)
        if self.transport is None:
            self.unsent.append(request)
        else:
            self.transport.write(request)

    @property
    def usable(self) -> bool:
        if self.closed:
            return False
        return bool(self.pending) or time.monotonic() - self.idle_since < _IDLE_S

    def fail(self) -> None:
        """End the connection; every pull still waiting on it gets ``None``."""
        self.closed = True
        self.unsent.clear()
        if self.transport is not None:
            self.transport.close()
        while self.pending:
            done, _ = self.pending.popleft()
            _call(done, None)


def _call(done: Done, pulled: Pulled) -> None:
    try:
        done(pulled)
    except Exception:  # a broken answer must not break the channel's other pulls
        logger.exception("pull callback failed")


class Puller:
    """One decode's pulls from its prefills: one channel per prefill address."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._channels: dict[tuple[str, int], _Channel] = {}
        self._sweeper: asyncio.TimerHandle | None = None

    def pull(self, target: PullTarget, done: Done) -> None:
        """Ask ``target`` for its held blocks; ``done`` gets the answer (or ``None``)."""
        key = (target.host, target.port)
        channel = self._channels.get(key)
        if channel is None or not channel.usable:
            if channel is not None:
                channel.fail()
            channel = self._open(target)
            self._channels[key] = channel
        channel.send(target.path, done, time.monotonic() + self.timeout_s)
        if self._sweeper is None:
            interval = min(1.0, self.timeout_s / 2)
            self._sweeper = asyncio.get_running_loop().call_later(interval, self._sweep)

    def _open(self, target: PullTarget) -> _Channel:
        host_header = f"host: {url_host(target.host)}:{target.port}\r\n".encode()
        channel = _Channel(host_header)
        loop = asyncio.get_running_loop()
        connecting = loop.create_task(
            asyncio.wait_for(
                loop.create_connection(lambda: channel, target.host, target.port),
                self.timeout_s,
            )
        )
        connecting.add_done_callback(lambda task: _connected(task, channel))
        return channel

    def _sweep(self) -> None:
        self._sweeper = None
        now = time.monotonic()
        for channel in self._channels.values():
            if channel.pending and channel.pending[0][1] <= now:
                channel.fail()
        self._channels = {k: c for k, c in self._channels.items() if not c.closed}
        if any(c.pending for c in self._channels.values()):
            interval = min(1.0, self.timeout_s / 2)
            self._sweeper = asyncio.get_running_loop().call_later(interval, self._sweep)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for channel in self._channels.values():
            channel.fail()
        self._channels.clear()


def _connected(task: asyncio.Task[Any], channel: _Channel) -> None:
    if task.cancelled() or task.exception() is not None:
        channel.fail()
