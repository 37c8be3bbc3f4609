"""Proves the KV-events subscriber (sidecar/kv_events/subscriber.py) on real ZMQ sockets on
loopback and ipc, against a fake engine publisher speaking vLLM's wire format
(tests/kv_event_builders.py):

- TCP: the sidecar binds (port 0 here), the publisher connects; its batches fill the index; a
  message of another topic, and a malformed message, do not stop the loop (the malformed one
  forgets, the next batch answers again);
- ipc: the publisher binds, the sidecar connects;
- a gap without a replay endpoint forgets and restarts from the waiting batch;
- a gap with a replay endpoint asks from the first missed number and applies the answers in
  order (vLLM's four-frame answers and SGLang's three-frame ones); answers that do not reach
  back to the gap, or no answer in time, forget (counted by outcome);
- the publisher's connection closing (an engine stopping) forgets at once;
- a receive that raises (the SUB socket's or the monitor's) makes the index unknown at once,
  counted (``reader_failed``) and said in one warning; the sockets are opened again on the
  same port and the publisher's next batches fill the index; a reopening that fails (the
  port held) is tried again; ``stop`` raises nothing of the reader's;
- a lookup applies the batches that reached the socket before it answers, however long ago
  the event loop last ran the reading task; a lookup whose receive fails answers unknown at
  once (counted once) and the reader reopens;
- on exit the tasks end and the sockets close: the port can be bound again, also when the
  caller of ``stop`` is cancelled meanwhile (its cancellation is raised, after the close); a
  port already bound stops start-up with one line naming the flag, also through
  ``open_runtime``.

It does not prove real vLLM's publisher (tests/real_vllm/test_kv_events_format.py for the
format; the cache-aware suite for the engine).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio
from kv_event_builders import TOKENS, FakePublisher, FakeReplay, chain, map_removed

from sidecar.kv_events.engine_cache import EngineKVCache
from sidecar.kv_events.subscriber import (
    EndpointUnavailable,
    KVEventsSubscriber,
    open_kv_events,
)
from sidecar.observability.metrics import Metrics

BS = 4
WAIT_S = 10.0


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def wait(subscriber: KVEventsSubscriber, predicate: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT_S):
        await subscriber.wait_until(predicate)


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def connected(context: zmq.asyncio.Context, subscriber: KVEventsSubscriber,
                    topic: bytes = b"kv") -> FakePublisher:
    publisher = FakePublisher(context, subscriber.endpoint, topic=topic)
    async with asyncio.timeout(WAIT_S):
        assert await publisher.subscribed() == b"\x01" + topic
    return publisher


async def test_tcp_batches_fill_the_index(context: zmq.asyncio.Context) -> None:
    metrics = Metrics()
    async with open_kv_events("tcp://127.0.0.1:0", None, topic="kv", max_blocks=100,
                              metrics=metrics) as subscriber:
        cache = subscriber.cache
        assert subscriber.endpoint.startswith("tcp://127.0.0.1:")
        publisher = await connected(context, subscriber)
        await publisher.send(12, [chain(TOKENS[:12], BS)])
        await wait(subscriber, lambda: cache.cached_tokens(TOKENS) == 12)
        await publisher.send_raw([b"kv-other", (13).to_bytes(8, "big"), b"x"])
        await publisher.send_raw([b"kv", b"bad"])
        await wait(subscriber, lambda: cache.cached_tokens(TOKENS) is None)
        await publisher.send(40, [chain(TOKENS[:8], BS)])
        await wait(subscriber, lambda: cache.cached_tokens(TOKENS) == 8)
        assert sample(metrics, "disagg_kv_event_batches_total", outcome="other_topic") == 1
        assert sample(metrics, "disagg_kv_event_batches_total", outcome="malformed") == 1
        assert sample(metrics, "disagg_kv_index_blocks") == 2
        publisher.close()


async def test_ipc_the_publisher_binds(context: zmq.asyncio.Context, tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/kv-events"
    publisher = FakePublisher(context, endpoint, bind=True, topic=b"")
    async with open_kv_events(endpoint, None, topic="", max_blocks=100) as subscriber:
        async with asyncio.timeout(WAIT_S):
            assert await publisher.subscribed() == b"\x01"
        await publisher.send(0, [chain(TOKENS[:8], BS)])
        await wait(subscriber, lambda: subscriber.cache.cached_tokens(TOKENS) == 8)
    publisher.close()


async def test_a_gap_without_replay_forgets(context: zmq.asyncio.Context) -> None:
    metrics = Metrics()
    async with open_kv_events("tcp://127.0.0.1:0", None, topic="kv", max_blocks=100,
                              metrics=metrics) as subscriber:
        cache = subscriber.cache
        publisher = await connected(context, subscriber)
        await publisher.send(0, [chain(TOKENS[:12], BS)])
        await wait(subscriber, lambda: cache.cached_tokens(TOKENS) == 12)
        # Batch 1 (which removed block 1) was lost: the index must not answer 12 any more.
        await publisher.send(2, [chain(TOKENS[:4], BS, first_hash=50)])
        await wait(subscriber, lambda: sample(metrics, "disagg_kv_events_gaps_total",
                                              cause="missed") == 1)
        assert cache.cached_tokens(TOKENS) == 4  # only what came after the gap
        publisher.close()


@pytest.mark.parametrize("with_topic", [True, False], ids=["vllm-answers", "sglang-answers"])
async def test_a_gap_is_replayed(context: zmq.asyncio.Context, with_topic: bool) -> None:
    metrics = Metrics()
    replay = FakeReplay(context, "tcp://127.0.0.1:0", with_topic=with_topic)
    replay.keep(0, [chain(TOKENS[:4], BS)])
    replay.keep(1, [map_stored_after_first()])
    replay.keep(2, [map_removed([1])])  # past the gap: the waiting batch is 2, not applied twice
    async with open_kv_events("tcp://127.0.0.1:0", replay.endpoint, topic="kv", max_blocks=100,
                              metrics=metrics) as subscriber:
        cache = subscriber.cache
        publisher = await connected(context, subscriber)
        await publisher.send(0, [chain(TOKENS[:4], BS)])
        await wait(subscriber, lambda: cache.cached_tokens(TOKENS) == 4)
        server = asyncio.ensure_future(replay.serve_one())
        await publisher.send(2, [chain(TOKENS[8:12], BS, first_hash=3, parent=2)])
        await wait(subscriber, lambda: sample(metrics, "disagg_kv_events_replays_total",
                                              outcome="complete") == 1)
        await server
        assert replay.requests == [1]
        assert cache.cached_tokens(TOKENS) == 12  # 0, the replayed 1, then the waiting 2
        assert sample(metrics, "disagg_kv_events_gaps_total", cause="missed") == 0
        publisher.close()
    replay.close()


def map_stored_after_first() -> dict[str, object]:
    return chain(TOKENS[4:8], BS, first_hash=2, parent=1)


async def test_an_incomplete_replay_forgets(context: zmq.asyncio.Context) -> None:
    metrics = Metrics()
    replay = FakeReplay(context, "tcp://127.0.0.1:0")
    replay.keep(2, [map_stored_after_first()])  # the engine's buffer no longer has 1
    async with open_kv_events("tcp://127.0.0.1:0", replay.endpoint, topic="kv", max_blocks=100,
                              metrics=metrics) as subscriber:
        cache = subscriber.cache
        publisher = await connected(context, subscriber)
        await publisher.send(0, [chain(TOKENS[:8], BS)])
        await wait(subscriber, lambda: cache.cached_tokens(TOKENS) == 8)
        server = asyncio.ensure_future(replay.serve_one())
        await publisher.send(3, [])
        await wait(subscriber, lambda: sample(metrics, "disagg_kv_events_replays_total",
                                              outcome="incomplete") == 1)
        await server
        assert cache.cached_tokens(TOKENS) == 0  # forgotten, then the (empty) waiting batch
        publisher.close()
    replay.close()


async def test_no_replay_answer_in_time_forgets(context: zmq.asyncio.Context) -> None:
    metrics = Metrics()
    silent = context.socket(zmq.ROUTER)  # bound, never answers
    silent.bind("tcp://127.0.0.1:0")
    async with open_kv_events("tcp://127.0.0.1:0", silent.getsockopt_string(zmq.LAST_ENDPOINT),
                              topic="kv", max_blocks=100, metrics=metrics,
                              replay_timeout_s=0.2) as subscriber:
        cache = subscriber.cache
        publisher = await connected(context, subscriber)
        await publisher.send(0, [chain(TOKENS[:8], BS)])
        await wait(subscriber, lambda: cache.cached_tokens(TOKENS) == 8)
        await publisher.send(5, [])
        await wait(subscriber, lambda: sample(metrics, "disagg_kv_events_replays_total",
                                              outcome="failed") == 1)
        assert cache.cached_tokens(TOKENS) == 0
        publisher.close()
    silent.close(linger=0)


async def test_the_publisher_going_away_forgets(context: zmq.asyncio.Context) -> None:
    metrics = Metrics()
    async with open_kv_events("tcp://127.0.0.1:0", None, topic="kv", max_blocks=100,
                              metrics=metrics) as subscriber:
        cache = subscriber.cache
        publisher = await connected(context, subscriber)
        await publisher.send(0, [chain(TOKENS[:8], BS)])
        await wait(subscriber, lambda: cache.cached_tokens(TOKENS) == 8)
        publisher.close()
        await wait(subscriber, lambda: cache.cached_tokens(TOKENS) is None)
        assert sample(metrics, "disagg_kv_events_gaps_total", cause="disconnected") == 1
        # The restarted engine connects again and counts from 0.
        publisher = await connected(context, subscriber)
        await publisher.send(0, [chain(TOKENS[:4], BS)])
        await wait(subscriber, lambda: cache.cached_tokens(TOKENS) == 4)
        publisher.close()


class FailingReceive:
    """A socket whose receive raises a ZMQ error once ``armed`` is set (a receive waiting
    then raises too); the rest is the real socket's. ``recv_multipart`` is awaitable (the
    monitor's) or blocking (the SUB socket's twin the reader drains), as the real one."""

    def __init__(self, real: Any, armed: bool = False) -> None:
        self._real = real
        self.armed = asyncio.Event()
        if armed:
            self.armed.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def getsockopt(self, option: int) -> Any:
        if self.armed.is_set() and not isinstance(self._real, zmq.asyncio.Socket):
            raise zmq.ZMQError(zmq.EFSM)  # a broken socket fails whatever is asked of it
        return self._real.getsockopt(option)

    def recv_multipart(self, flags: int = 0) -> Any:
        if isinstance(self._real, zmq.asyncio.Socket):
            return self._recv_async()
        if self.armed.is_set():
            raise zmq.ZMQError(zmq.EFSM)
        return self._real.recv_multipart(flags)

    async def _recv_async(self) -> list[bytes]:
        receive = asyncio.ensure_future(self._real.recv_multipart())
        armed = asyncio.ensure_future(self.armed.wait())
        try:
            await asyncio.wait({receive, armed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            armed.cancel()
        if receive.done():
            frames: list[bytes] = receive.result()
            return frames
        receive.cancel()
        raise zmq.ZMQError(zmq.EFSM)


@pytest.mark.parametrize("which", ["_sync", "_monitor"])
async def test_a_failed_receive_forgets_and_reads_again(
    context: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture, which: str,
) -> None:
    metrics = Metrics()
    cache = EngineKVCache(100, topic=b"kv", metrics=metrics)
    subscriber = KVEventsSubscriber(cache, "tcp://127.0.0.1:0", None)
    endpoint = subscriber.endpoint
    failing = FailingReceive(getattr(subscriber, which))
    setattr(subscriber, which, failing)
    caplog.set_level(logging.INFO, logger="sidecar.kv_events")
    subscriber.start()
    try:
        publisher = await connected(context, subscriber)
        await publisher.send(0, [chain(TOKENS[:8], BS)])
        await wait(subscriber, lambda: cache.cached_tokens(TOKENS) == 8)
        failing.armed.set()
        await publisher.send(1, [])  # wakes the reader (the monitor's receive fails at once)
        await wait(subscriber, lambda: sample(metrics, "disagg_kv_events_gaps_total",
                                              cause="reader_failed") == 1)
        # Whatever it held is not believed: the reader stopped following the engine.
        assert cache.cached_tokens(TOKENS) is None
        failures = [r for r in caplog.records if "receiving failed" in r.getMessage()]
        assert len(failures) == 1 and failures[0].levelno == logging.WARNING
        assert "ZMQError" in failures[0].getMessage()
        # The sockets open again on the same port; the publisher reconnects by itself (its
        # XPUB first passes on the closed socket's unsubscription).
        async with asyncio.timeout(WAIT_S):
            while await publisher.subscribed() != b"\x01kv":
                pass
        assert subscriber.endpoint == endpoint
        await publisher.send(2, [chain(TOKENS[:12], BS)])
        await wait(subscriber, lambda: cache.cached_tokens(TOKENS) == 12)
        assert sample(metrics, "disagg_kv_events_gaps_total", cause="reader_failed") == 1
        publisher.close()
    finally:
        await subscriber.stop()  # nothing of the reader's is raised here


async def test_reopening_is_tried_again_until_it_succeeds(
    context: zmq.asyncio.Context,
) -> None:
    cache = EngineKVCache(100, topic=b"kv")
    subscriber = KVEventsSubscriber(cache, "tcp://127.0.0.1:0", None, reopen_s=(0.01, 0.05))
    subscriber._sync = FailingReceive(subscriber._sync, armed=True)  # type: ignore[assignment]
    opened: list[str] = []
    really_open = subscriber._open

    def open_held_twice(endpoint: str) -> None:
        opened.append(endpoint)
        if len(opened) <= 2:  # the closed socket still holds the port, say
            raise EndpointUnavailable(f"--kv-events-endpoint {endpoint}: Address in use")
        really_open(endpoint)

    subscriber._open = open_held_twice  # type: ignore[method-assign]
    subscriber.start()
    try:
        await wait(subscriber, lambda: len(opened) == 3)
        assert opened == [subscriber.endpoint] * 3
        publisher = await connected(context, subscriber)
        await publisher.send(0, [chain(TOKENS[:8], BS)])
        await wait(subscriber, lambda: cache.cached_tokens(TOKENS) == 8)
        publisher.close()
    finally:
        await subscriber.stop()


async def test_a_lookup_applies_what_reached_the_socket(context: zmq.asyncio.Context) -> None:
    """The event loop has not run the reading task since the batch arrived (nothing awaited
    in between): the lookup applies it itself. (Before: the index answered from before it.)"""
    async with open_kv_events("tcp://127.0.0.1:0", None, topic="kv",
                              max_blocks=100) as subscriber:
        cache = subscriber.cache
        publisher = await connected(context, subscriber)
        await publisher.send(0, [chain(TOKENS[:8], BS)])
        await wait(subscriber, lambda: cache.cached_tokens(TOKENS) == 8)
        await publisher.send(1, [map_removed([2])])
        assert subscriber._sub is not None
        peek = zmq.Socket.shadow(subscriber._sub.underlying)
        assert peek.poll(int(WAIT_S * 1000))  # blocking: the loop runs nothing meanwhile
        assert cache.cached_tokens(TOKENS) == 4
        publisher.close()


async def test_a_lookup_that_meets_a_failed_receive_answers_unknown(
    context: zmq.asyncio.Context,
) -> None:
    metrics = Metrics()
    cache = EngineKVCache(100, topic=b"kv", metrics=metrics)
    subscriber = KVEventsSubscriber(cache, "tcp://127.0.0.1:0", None)
    failing = FailingReceive(subscriber._sync)
    subscriber._sync = failing  # type: ignore[assignment]
    subscriber.start()
    try:
        publisher = await connected(context, subscriber)
        await publisher.send(0, [chain(TOKENS[:8], BS)])
        await wait(subscriber, lambda: cache.cached_tokens(TOKENS) == 8)
        failing.armed.set()
        assert cache.cached_tokens(TOKENS) is None  # at once, not after the task's next look
        assert sample(metrics, "disagg_kv_events_gaps_total", cause="reader_failed") == 1
        # The task reopens (counted once) and the publisher's batches are heard again.
        async with asyncio.timeout(WAIT_S):
            while await publisher.subscribed() != b"\x01kv":
                pass
        await publisher.send(1, [chain(TOKENS[:12], BS)])
        await wait(subscriber, lambda: cache.cached_tokens(TOKENS) == 12)
        assert sample(metrics, "disagg_kv_events_gaps_total", cause="reader_failed") == 1
        publisher.close()
    finally:
        await subscriber.stop()


async def test_stop_raises_the_callers_cancellation_after_closing(
    context: zmq.asyncio.Context,
) -> None:
    cache = EngineKVCache(10)
    subscriber = KVEventsSubscriber(cache, "tcp://127.0.0.1:0", None)
    subscriber.start()
    reading = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]

    async def stop_while_cancelled() -> None:
        current = asyncio.current_task()
        assert current is not None
        current.cancel()  # the caller is cancelled while stop() waits for the reader
        await subscriber.stop()

    stopping = asyncio.ensure_future(stop_while_cancelled())
    await asyncio.wait({stopping})
    assert stopping.cancelled()  # before: swallowed, the caller ran on as if never cancelled
    assert reading and all(task.done() for task in reading)
    again = context.socket(zmq.SUB)
    again.bind(subscriber.endpoint)  # closed: free again
    again.close(linger=0)


async def test_exit_closes_the_socket_and_a_held_port_is_one_line(
    context: zmq.asyncio.Context,
) -> None:
    async with open_kv_events("tcp://127.0.0.1:0", None, topic="", max_blocks=10) as subscriber:
        endpoint = subscriber.endpoint
        task = subscriber._task
        with pytest.raises(EndpointUnavailable, match=r"^--kv-events-endpoint tcp://127\.0\.0\.1"):
            async with open_kv_events(endpoint, None, topic="", max_blocks=10):
                pass
    assert task is not None and task.done()
    again = context.socket(zmq.SUB)
    again.bind(endpoint)  # free again
    again.close(linger=0)
