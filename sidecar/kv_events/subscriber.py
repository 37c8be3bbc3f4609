"""The sockets that hear the local engine's KV events, and the task that reads them.

    open_kv_events(endpoint, ...) ─▶ SUB bound (or connected) at the endpoint, topic filter
                                     + its connection monitor (+ DEALER to the replay endpoint)
        task: socket readable ─▶ drain(): every message waiting, in order, without blocking:
              frames ─decode─▶ EngineKVCache.receive ─▶ Gap? ─replay─▶ apply missed, then it
                                                              └─ no replay / incomplete: forget
              monitor: connection closed ─▶ EngineKVCache.disconnected (forget)
        lookup (cached_tokens) ─▶ drain() first: what reached the socket is applied before the
              index answers, however busy the event loop is
        a receive that raises (either socket) ─▶ forget (``reader_failed``, one warning), close
              the sockets, open them again after a back-off (0.1 s, doubling to 5 s while
              nothing is heard), read on
    exit ─▶ the task cancelled and waited for, every socket closed (linger 0), the context's
            sockets gone; the caller's own cancellation is raised after that

Gaps: with a replay endpoint the missed batches are asked for (DEALER ``[b"", first
sequence]``; the engine's ROUTER answers each buffered batch from that number as ``[b"",
topic, sequence, payload]`` (SGLang: without the topic) and ends with sequence -1); applied in
order when they reach back to the gap, else (the engine's buffer no longer holds them, no
answer within ``replay_timeout_s``) the index forgets and restarts from the waiting batch.
Without a replay endpoint a gap forgets. A numbering that went back (an engine restart) always
forgets.

A reader that fails must not leave the index answering from a state it stopped following:
until the events are heard again the index answers None, and the length rule decides.

Why a lookup drains: the batches reach the socket on ZMQ's own I/O thread, but the reading
task applies them only when the event loop gets to it, and a loop busy with requests got to
it tens of milliseconds later, once 778 ms (bench/RESULTS.md, "The index's lag"); the placement
decision is the one moment the index must be current, so it takes what has arrived itself
(a look at the socket, 5 us on the test machine when nothing waits). A gap that needs a replay
is left to the task (the index answers None meanwhile).

Deliberate limits: one process binds the endpoint, so a pool of workers is refused at start
(``sidecar.config.checks``); a batch is applied on the event loop (microseconds per block);
while the sockets are reopened a bound TCP port may be briefly held by the closed socket (the
next try after the back-off takes it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Final

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from sidecar.kv_events.endpoint import is_ipv6, sidecar_binds
from sidecar.kv_events.engine_cache import (
    CAUSE_MISSED,
    CAUSE_READER_FAILED,
    CAUSE_RESTARTED,
    EngineKVCache,
    Gap,
)
from sidecar.kv_events.wire import (
    END_OF_REPLAY,
    MalformedMessage,
    Message,
    decode_batch,
    decode_message,
    decode_sequence,
)
from sidecar.observability.metrics import Metrics
from sidecar.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

#: Batches the SUB socket queues before ZMQ drops (the publishers' own default).
RECEIVE_HWM: Final = 100_000
REPLAY_TIMEOUT_S: Final = 2.0
#: The reading task looks at the socket at least this often even when nothing woke it (a
#: failure a lookup's drain met is acted on by then).
POLL_MS: Final = 1000
#: After a failed receive: the first wait before the sockets are opened again, and the most
#: (the wait doubles while nothing is heard between failures).
REOPEN_FIRST_S: Final = 0.1
REOPEN_MAX_S: Final = 5.0
#: Replay outcomes (``disagg_kv_events_replays_total{outcome}``).
REPLAY_COMPLETE = "complete"
REPLAY_INCOMPLETE = "incomplete"
REPLAY_FAILED = "failed"


class EndpointUnavailable(Exception):
    """The events endpoint cannot be bound or connected (one line: the flag and why)."""


def _socket(context: zmq.asyncio.Context, kind: int, endpoint: str) -> zmq.asyncio.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if is_ipv6(endpoint):
        sock.setsockopt(zmq.IPV6, 1)
    return sock


class KVEventsSubscriber:
    """The SUB socket at the events endpoint, its monitor, the replay DEALER, the reading task."""

    def __init__(self, cache: EngineKVCache, endpoint: str, replay_endpoint: str | None,
                 replay_timeout_s: float = REPLAY_TIMEOUT_S,
                 reopen_s: tuple[float, float] = (REOPEN_FIRST_S, REOPEN_MAX_S)) -> None:
        self.cache = cache
        self._context = zmq.asyncio.Context()
        self._replay_endpoint = replay_endpoint
        self._replay_timeout_s = replay_timeout_s
        self._reopen_first_s, self._reopen_max_s = reopen_s
        self._replay: zmq.asyncio.Socket | None = None
        self._sub: zmq.asyncio.Socket | None = None
        #: The SUB socket's blocking twin (the same socket): drains without a future.
        self._sync: zmq.Socket[bytes] | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        #: A gap waiting for its replay (the task's), and a failure a lookup's drain met.
        self._gap: Gap | None = None
        self._failure: str | None = None
        self._task: asyncio.Task[None] | None = None
        #: Messages handled since the sockets were (re)opened.
        self._heard = 0
        #: Set after each message or connection event handled (``wait_until``).
        self._handled = asyncio.Event()
        try:
            self._open(endpoint)
            assert self._sub is not None
            #: The endpoint as bound (port 0: the port the OS chose) or connected.
            self.endpoint: str = self._sub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        except BaseException:
            self.close()
            raise

    def _open(self, endpoint: str) -> None:
        """The SUB socket bound or connected at ``endpoint``, with its monitor."""
        sub = self._sub = _socket(self._context, zmq.SUB, endpoint)
        sub.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        sub.setsockopt(zmq.SUBSCRIBE, self.cache.topic)
        self._monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            if sidecar_binds(endpoint):
                sub.bind(endpoint)
            else:
                sub.connect(endpoint)
        except zmq.ZMQError as exc:
            raise EndpointUnavailable(
                f"--kv-events-endpoint {endpoint}: {exc.strerror}") from None
        self._sync = zmq.Socket.shadow(sub.underlying)
        self._heard = 0
        self._gap = None
        self._failure = None
        self.cache.refresh = self._drain_for_lookup

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """End the reading task and close every socket; the caller's own cancellation, if it
        comes meanwhile, is raised after both."""
        try:
            if self._task is not None:
                await cancel_and_wait(self._task)
        finally:
            self._task = None
            self.close()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds, checked after each message or connection event
        handled (tests and tools; the caller bounds the wait)."""
        while not predicate():
            self._handled.clear()
            await self._handled.wait()

    def close(self) -> None:
        """Close every socket and the context (idempotent)."""
        self._close_sockets()
        self._context.term()

    def _close_sockets(self) -> None:
        self.cache.refresh = None
        self._sync = None  # a shadow: closing the SUB socket closes it
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None
        if self._sub is not None:
            if self._monitor is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self._sub.disable_monitor()
            self._sub.close(linger=0)
            self._sub = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None

    async def _run(self) -> None:
        """Read until cancelled; after a failed receive, forget and open the sockets again."""
        failures = 0  # in a row, nothing heard in between
        while True:
            failure = await self._read_until_failure()
            failures = failures + 1 if self._heard == 0 else 1
            wait_s = min(self._reopen_first_s * 2 ** (failures - 1), self._reopen_max_s)
            logger.warning("kv events: receiving failed (%s); the index answers unknown "
                           "until events are heard again; reopening %s in %.1f s",
                           failure, self.endpoint, wait_s)
            if self._failure is None:  # else the lookup that met it forgot already
                self.cache.forget(CAUSE_READER_FAILED, log=False)
            self._handled.set()
            self._close_sockets()
            while True:
                await asyncio.sleep(wait_s)
                try:
                    self._open(self.endpoint)
                    self._handled.set()
                    break
                except (EndpointUnavailable, zmq.ZMQError) as exc:
                    # The closed socket may still hold a bound port for a moment.
                    self._close_sockets()
                    wait_s = min(2 * wait_s, self._reopen_max_s)
                    logger.debug("kv events: reopening failed (%s); next try in %.1f s",
                                 exc, wait_s)

    async def _read_until_failure(self) -> str:
        """Run the reading loops until one of them fails; what failed, in a few words."""
        tasks = [asyncio.ensure_future(self._read()),
                 asyncio.ensure_future(self._watch_connections())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait(*tasks)
        ended = done.pop()
        if ended.cancelled():
            return "the receive was cancelled"
        error = ended.exception()
        return "the loop ended" if error is None else f"{type(error).__name__}: {error}"

    async def _read(self) -> None:
        sub = self._sub
        assert sub is not None
        while True:
            await sub.poll(POLL_MS)
            if self._failure is not None:
                raise ConnectionError(self._failure)
            self.drain()
            gap = self._gap
            if gap is not None:
                await self._replay_gap(gap)
                self._gap = None
                self._handled.set()

    def drain(self) -> None:
        """Apply every message waiting in the socket, in order, without blocking; stops at a
        gap that needs a replay (the task replays it). A receive that fails raises."""
        sync = self._sync
        if sync is None or self._gap is not None:
            return
        while int(sync.getsockopt(zmq.EVENTS)) & zmq.POLLIN:  # cheaper than a failed receive
            try:
                frames = sync.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            received = time.time()
            self._heard += 1
            try:
                self._gap = self._take(frames, received)
            except Exception:
                # A bug must not leave the index answering from a state it stopped following.
                logger.exception("kv events: a message could not be handled; index forgotten")
                self.cache.malformed()
            self._handled.set()
            if self._gap is not None:
                return

    def _drain_for_lookup(self) -> None:
        """``drain`` for the index's lookup: a failure makes the index unknown at once (the
        task, at its next look, says why and reopens); nothing is raised to the caller."""
        if self._failure is not None:
            return
        try:
            self.drain()
        except Exception as exc:  # the task's own drain meets it again and reopens
            self._failure = f"{type(exc).__name__}: {exc}"
            self.cache.forget(CAUSE_READER_FAILED, log=False)

    def _take(self, frames: list[bytes], received: float) -> Gap | None:
        """Apply one message (or drop it); the gap it opened if that needs a replay."""
        if frames and not self.cache.wants(frames[0]):
            return None
        try:
            message = decode_message(frames)
        except MalformedMessage as exc:
            logger.warning("kv events: dropped a message: %s", exc)
            self.cache.malformed()
            return None
        gap = self.cache.receive(message)
        if gap is not None:
            if gap.restarted or self._replay_endpoint is None:
                self.cache.forget(CAUSE_RESTARTED if gap.restarted else CAUSE_MISSED)
                self.cache.apply(gap.message)
                gap = None
            else:
                self.cache.catching_up = True  # answers None until the replay is done
        if logger.isEnabledFor(logging.DEBUG):
            stamp = message.batch.ts
            logger.debug("kv events: batch %d stamped %.6f received +%.1f ms handled +%.1f ms",
                         message.sequence, stamp, (received - stamp) * 1000,
                         (time.time() - stamp) * 1000)
        return gap

    async def _replay_gap(self, gap: Gap) -> None:
        """Ask for the batches a gap missed and apply them, then the one waiting; forget when
        they do not all come (the index answered None meanwhile: ``catching_up``)."""
        try:
            missed = await self._ask_replay(gap.first)
        finally:
            self.cache.catching_up = False
        wanted = [m for m in missed or () if gap.first <= m.sequence < gap.upto]
        if missed is None or [m.sequence for m in wanted] != list(range(gap.first, gap.upto)):
            self.cache.replayed(REPLAY_FAILED if missed is None else REPLAY_INCOMPLETE)
            self.cache.forget(CAUSE_MISSED)
            self.cache.apply(gap.message)
            return
        for message in wanted:
            self.cache.apply(message)
        self.cache.replayed(REPLAY_COMPLETE)
        self.cache.apply(gap.message)

    async def _ask_replay(self, first: int) -> list[Message] | None:
        """The batches the engine still buffers from ``first`` on; None when it did not
        answer in time or answered something unreadable."""
        if self._replay is None:
            assert self._replay_endpoint is not None
            self._replay = _socket(self._context, zmq.DEALER, self._replay_endpoint)
            self._replay.connect(self._replay_endpoint)
        try:
            async with asyncio.timeout(self._replay_timeout_s):
                await self._replay.send_multipart([b"", first.to_bytes(8, "big")])
                return await self._replay_answers(self._replay)
        except (TimeoutError, MalformedMessage, zmq.ZMQError) as exc:
            logger.warning("kv events: replay from %d failed: %s", first, exc or "timed out")
            # A late answer must not be read as the next replay's: a fresh socket.
            self._replay.close(linger=0)
            self._replay = None
            return None

    async def _replay_answers(self, replay: zmq.asyncio.Socket) -> list[Message]:
        answers: list[Message] = []
        while True:
            frames = await replay.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) == 3:  # topic, sequence, payload
                topic, sequence, payload = frames
            elif len(frames) == 2:  # sequence, payload
                topic, (sequence, payload) = self.cache.topic, frames
            else:
                raise MalformedMessage(f"replay answer of {len(frames)} frames")
            if sequence == END_OF_REPLAY:
                return answers
            answers.append(Message(topic, decode_sequence(sequence), decode_batch(payload)))

    async def _watch_connections(self) -> None:
        monitor = self._monitor
        assert monitor is not None
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                logger.info("kv events: the publisher's connection closed")
                self.cache.disconnected()
            self._handled.set()


@contextlib.asynccontextmanager
async def open_kv_events(endpoint: str, replay_endpoint: str | None, *, topic: str,
                         max_blocks: int, metrics: Metrics | None = None,
                         replay_timeout_s: float = REPLAY_TIMEOUT_S,
                         ) -> AsyncIterator[KVEventsSubscriber]:
    """The subscriber, reading; on exit its task is cancelled and its sockets closed."""
    cache = EngineKVCache(max_blocks, topic=topic.encode(), metrics=metrics)
    subscriber = KVEventsSubscriber(cache, endpoint, replay_endpoint, replay_timeout_s)
    subscriber.start()
    logger.info("kv events: %s %s%s", "bound" if sidecar_binds(endpoint) else "connected to",
                subscriber.endpoint,
                f", replay from {replay_endpoint}" if replay_endpoint else "")
    try:
        yield subscriber
    finally:
        await subscriber.stop()
