"""Proves that inline Prefill streams KV layer by layer while the engine computes.

A stub prefill engine (aiohttp on loopback, in this process) plays SidecarKVConnector's part
on a staging root shared with a real sidecar (``grpc_sidecar``, ``--kv-transport inline``):
it writes layer files atomically and sends the connector's notices (``send_notice``), and
each test decides, with asyncio events and no sleeps, when it answers its prefill call. The
test is the router: it reads the Prefill stream.

Proves: the metadata block is sent before the engine answers (announced from engine.json)
and layer 0's blocks reach the router while the engine still holds its answer; lost notices
are harmless (a later notice sends the layers before it, the engine's answer sends the
rest); the stream is metadata, every block in layer order, ``done``, byte for byte what the
engine wrote; without engine.json the stream starts at the answer; a missing layer file, a
meta.json that disagrees with the announcement and an engine failure end the stream with
FAILED_PRECONDITION / UNAVAILABLE and no ``done``; KV over the staging bound is refused
before the engine is called; a router that cancels mid-stream makes the sidecar abort the
engine call, remove everything it staged and keep no task running. After every case the
staging root holds nothing but engine.json.

Does not prove: real vLLM timing (tests/real_vllm/test_inline_kv.py does), uvloop (the
notice socket on uvloop is covered in test_layer_notices.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiohttp import web
from grpc_server.grpc_builders import CHANNEL_OPTIONS, GrpcSidecar, grpc_sidecar

from connectors.inline_layout import (
    ENGINE_FILE,
    META_FILE,
    InlineLayout,
    InlineMeta,
    layer_file,
    notice_sender,
    send_notice,
    write_atomic,
)
from sidecar.config.settings import KVTransport
from sidecar.grpc_gen import disagg_pb2, disagg_pb2_grpc

LAYOUT = InlineLayout(
    dtype="float32", block_size=4, num_kv_heads=2, head_size=8, num_layers=3, fingerprint="f0"
)
PROMPT = list(range(100, 110))  # 10 tokens: 3 blocks of 4
NUM_BLOCKS = 3
#: A guard against a hang when the code under test is broken; never reached when it works.
GUARD_S = 30


def layer_bytes(layer: int) -> bytes:
    size = NUM_BLOCKS * LAYOUT.block_bytes
    return bytes((layer * 67 + i * 13) % 251 for i in range(size))


Behaviour = Callable[["KVEngine", str], Awaitable[int]]


@dataclass
class KVEngine:
    """A prefill engine that writes inline KV like SidecarKVConnector; ``behaviour`` decides
    what it writes and when it answers (it returns the HTTP status)."""

    root: Path
    behaviour: Behaviour
    answered: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    calls: int = 0
    url: str = ""

    def __post_init__(self) -> None:
        self._sock = notice_sender()

    def write_layer(self, key: str, layer: int, *, notify: bool = True) -> None:
        directory = self.root / key
        directory.mkdir(exist_ok=True)
        write_atomic(directory / layer_file(layer), layer_bytes(layer))
        if notify:
            assert send_notice(self._sock, self.root, key, layer)

    def write_meta(self, key: str, num_tokens: int = len(PROMPT)) -> None:
        meta = InlineMeta(LAYOUT, num_tokens, -(-num_tokens // LAYOUT.block_size), key)
        write_atomic(self.root / key / META_FILE, meta.to_json())

    async def completions(self, request: web.Request) -> web.Response:
        self.calls += 1
        body: dict[str, Any] = await request.json()
        key = body["kv_transfer_params"]["disagg_inline"]["key"]
        assert body["prompt"] == PROMPT and body["max_tokens"] == 1
        try:
            status = await self.behaviour(self, key)
        except asyncio.CancelledError:
            self.aborted.set()  # the sidecar hung up: vLLM aborts the request here
            raise
        self.answered.set()
        if status != 200:
            return web.json_response({"error": "boom"}, status=status)
        return web.json_response(
            {"id": "x", "choices": [{"index": 0, "text": "a", "finish_reason": "length"}]}
        )

    def close(self) -> None:
        self._sock.close()


@contextlib.asynccontextmanager
async def kv_engine(root: Path, behaviour: Behaviour) -> AsyncIterator[KVEngine]:
    engine = KVEngine(root, behaviour)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", engine.completions)
    # Handlers are cancelled when the client hangs up, as vLLM's server notices disconnects.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    engine.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield engine
    finally:
        engine.close()
        await runner.cleanup()


@pytest.fixture
def root() -> Iterator[Path]:
    # Short on purpose: the notice socket's path must fit sun_path (pytest's tmp_path may not).
    shm = Path("/dev/shm")
    path = Path(tempfile.mkdtemp(prefix="kvs-", dir=shm if shm.is_dir() else None))
    write_atomic(path / ENGINE_FILE, json.dumps(LAYOUT.to_dict()).encode())
    yield path
    shutil.rmtree(path, ignore_errors=True)


@contextlib.asynccontextmanager
async def inline_sidecar(engine: KVEngine, **overrides: Any) -> AsyncIterator[GrpcSidecar]:
    # Page-sized blocks unless a test asks for runs (test_kv_runs.py covers those).
    overrides.setdefault("kv_block_bytes", LAYOUT.block_bytes)
    async with grpc_sidecar(
        engine.url,
        engine="vllm",
        kv_connector="shfs",
        role="prefill",
        kv_transport=KVTransport.INLINE,
        kv_staging_dir=str(engine.root),
        **overrides,
    ) as side:
        yield side


def leftovers(root: Path) -> list[str]:
    """Everything in the staging root but the engine's own engine.json."""
    return sorted(p.name for p in root.iterdir() if p.name != ENGINE_FILE)


def engine_tasks() -> list[asyncio.Task[Any]]:
    """Engine calls of inline Prefill still running in this loop."""
    return [
        t for t in asyncio.all_tasks()
        if not t.done() and "InlinePrefill._engine_call" in repr(t.get_coro())
    ]


def expected_data_blocks() -> list[tuple[int, int, bytes, bytes]]:
    tile = LAYOUT.tile_bytes
    out = []
    for layer in range(LAYOUT.num_layers):
        data = layer_bytes(layer)
        for j in range(NUM_BLOCKS):
            out.append((layer, j, data[2 * j * tile : (2 * j + 1) * tile],
                        data[(2 * j + 1) * tile : (2 * j + 2) * tile]))
    return out


@dataclass
class Received:
    messages: list[disagg_pb2.KVBlockStream] = field(default_factory=list)
    status: grpc.StatusCode | None = None
    details: str = ""

    @property
    def blocks(self) -> list[disagg_pb2.KVBlock]:
        return [m.block for m in self.messages if m.HasField("block")]

    @property
    def done(self) -> bool:
        return any(m.done for m in self.messages)


async def route(
    address: str,
    on_message: Callable[[Received], None] | None = None,
) -> Received:
    """The router: read the Prefill stream to its end (so the server's handler has ended)."""
    received = Received()
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        call = disagg_pb2_grpc.PrefillWorkerStub(channel).Prefill(
            disagg_pb2.PreFillRequest(request_id="r-1", token_ids=PROMPT), timeout=GUARD_S
        )
        try:
            async for message in call:
                received.messages.append(message)
                if on_message is not None:
                    on_message(received)
        except grpc.aio.AioRpcError as exc:
            received.status, received.details = exc.code(), exc.details() or ""
            return received
    received.status = grpc.StatusCode.OK
    return received


def layer_complete(received: Received, layer: int) -> bool:
    return sum(1 for b in received.blocks if b.layer_idx == layer) == NUM_BLOCKS


async def guarded(event: asyncio.Event) -> None:
    async with asyncio.timeout(GUARD_S):
        await event.wait()


async def test_layers_stream_while_the_engine_computes(root: Path) -> None:
    layer0_received = asyncio.Event()
    answered_when_layer0_arrived: list[bool] = []

    async def behaviour(engine: KVEngine, key: str) -> int:
        engine.write_layer(key, 0)
        await guarded(layer0_received)  # no answer until the router has layer 0
        engine.write_layer(key, 1)
        engine.write_layer(key, 2, notify=False)  # a lost notice: read at the answer
        engine.write_meta(key)
        return 200

    async with kv_engine(root, behaviour) as engine, inline_sidecar(engine) as side:

        def on_message(received: Received) -> None:
            if not layer0_received.is_set() and layer_complete(received, 0):
                answered_when_layer0_arrived.append(engine.answered.is_set())
                layer0_received.set()

        received = await route(side.address, on_message)
    assert received.status == grpc.StatusCode.OK, received.details
    assert answered_when_layer0_arrived == [False]
    blocks = received.blocks
    meta = InlineMeta.from_json(blocks[0].k_data)
    assert blocks[0].layer_idx == -2 and meta.layout == LAYOUT
    assert (meta.num_tokens, meta.num_blocks) == (len(PROMPT), NUM_BLOCKS)
    got = [(b.layer_idx, b.block_idx, b.k_data, b.v_data) for b in blocks[1:]]
    assert got == expected_data_blocks()
    assert all(b.request_id == "r-1" for b in blocks)
    assert received.messages[-1].done and not received.messages[-1].HasField("block")
    assert leftovers(root) == []
    assert side.metric("disagg_kv_bytes_total", direction="out") == (
        len(blocks[0].k_data) + LAYOUT.num_layers * NUM_BLOCKS * LAYOUT.block_bytes
    )


async def test_a_later_notice_sends_the_layers_before_it(root: Path) -> None:
    all_received = asyncio.Event()

    async def behaviour(engine: KVEngine, key: str) -> int:
        engine.write_layer(key, 0, notify=False)
        engine.write_layer(key, 1, notify=False)
        engine.write_layer(key, 2)  # only the last notice arrives
        await guarded(all_received)
        engine.write_meta(key)
        return 200

    async with kv_engine(root, behaviour) as engine, inline_sidecar(engine) as side:

        def on_message(received: Received) -> None:
            if not all_received.is_set() and layer_complete(received, 2):
                assert not engine.answered.is_set()
                all_received.set()

        received = await route(side.address, on_message)
    assert received.status == grpc.StatusCode.OK, received.details
    assert all_received.is_set()
    got = [(b.layer_idx, b.block_idx, b.k_data, b.v_data) for b in received.blocks[1:]]
    assert got == expected_data_blocks()
    assert leftovers(root) == []


async def test_without_engine_json_the_stream_starts_at_the_answer(root: Path) -> None:
    (root / ENGINE_FILE).unlink()

    async def behaviour(engine: KVEngine, key: str) -> int:
        for layer in range(LAYOUT.num_layers):
            engine.write_layer(key, layer)
        engine.write_meta(key)
        return 200

    async with kv_engine(root, behaviour) as engine, inline_sidecar(engine) as side:
        received = await route(side.address)
    assert received.status == grpc.StatusCode.OK, received.details
    assert InlineMeta.from_json(received.blocks[0].k_data).num_blocks == NUM_BLOCKS
    got = [(b.layer_idx, b.block_idx, b.k_data, b.v_data) for b in received.blocks[1:]]
    assert got == expected_data_blocks() and received.done
    assert leftovers(root) == []


async def test_missing_layer_file_ends_the_stream_with_failed_precondition(root: Path) -> None:
    async def behaviour(engine: KVEngine, key: str) -> int:
        engine.write_layer(key, 0)
        engine.write_layer(key, 2)  # layer 1 never written
        engine.write_meta(key)
        return 200

    async with kv_engine(root, behaviour) as engine, inline_sidecar(engine) as side:
        received = await route(side.address)
    assert received.status == grpc.StatusCode.FAILED_PRECONDITION
    assert "layer 1" in received.details
    assert not received.done
    assert {b.layer_idx for b in received.blocks} <= {-2, 0}  # layer 2 never jumps the gap
    assert leftovers(root) == []


async def test_meta_disagreeing_with_the_announcement_is_failed_precondition(
    root: Path,
) -> None:
    async def behaviour(engine: KVEngine, key: str) -> int:
        for layer in range(LAYOUT.num_layers):
            engine.write_layer(key, layer)
        engine.write_meta(key, num_tokens=len(PROMPT) - 1)  # same blocks, other token count
        return 200

    async with kv_engine(root, behaviour) as engine, inline_sidecar(engine) as side:
        received = await route(side.address)
    assert received.status == grpc.StatusCode.FAILED_PRECONDITION
    assert "not as announced" in received.details
    assert not received.done
    assert leftovers(root) == []


async def test_engine_failure_after_blocks_were_sent(root: Path) -> None:
    async def behaviour(engine: KVEngine, key: str) -> int:
        engine.write_layer(key, 0)
        return 500

    async with kv_engine(root, behaviour) as engine, inline_sidecar(engine) as side:
        received = await route(side.address)
    assert received.status == grpc.StatusCode.UNAVAILABLE
    assert not received.done
    assert leftovers(root) == []


async def test_kv_over_the_staging_bound_is_refused_before_the_engine_runs(root: Path) -> None:
    async def behaviour(engine: KVEngine, key: str) -> int:
        raise AssertionError("the engine must not be called")  # pragma: no cover

    limit = LAYOUT.num_layers * NUM_BLOCKS * LAYOUT.block_bytes - 1
    async with (
        kv_engine(root, behaviour) as engine,
        inline_sidecar(engine, max_staged_bytes=limit) as side,
    ):
        received = await route(side.address)
    assert received.status == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert received.messages == [] and engine.calls == 0
    assert leftovers(root) == []


async def test_cancel_mid_stream_aborts_the_engine_and_leaves_nothing(root: Path) -> None:
    never = asyncio.Event()

    async def behaviour(engine: KVEngine, key: str) -> int:
        engine.write_layer(key, 0)
        await never.wait()  # computing forever, until the sidecar hangs up
        return 200  # pragma: no cover

    async with kv_engine(root, behaviour) as engine, inline_sidecar(engine) as side:
        async with grpc.aio.insecure_channel(side.address, options=CHANNEL_OPTIONS) as channel:
            call = disagg_pb2_grpc.PrefillWorkerStub(channel).Prefill(
                disagg_pb2.PreFillRequest(request_id="r-c", token_ids=PROMPT), timeout=GUARD_S
            )
            received = Received()
            async for message in call:
                received.messages.append(message)
                if layer_complete(received, 0):
                    break
            assert len(leftovers(root)) == 2  # the request's directory and notice socket
            call.cancel()
        await guarded(engine.aborted)
        # The handler leaves admission last, after its clean-up.
        assert await side.runtime.admission.wait_idle(GUARD_S)
        assert leftovers(root) == []
        assert engine_tasks() == []
        assert not engine.answered.is_set()
        assert side.metric("disagg_requests_total", outcome="cancelled") == 1
