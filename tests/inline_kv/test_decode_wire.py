"""Proves inline Decode on a real sidecar (``grpc_sidecar``, ``--kv-transport inline``) that
takes the request's bytes and walks them (``sidecar.grpc_server.inline.protowire``): a
DecodeRequest from a
generated client and one framed by a router from KVBlockStream slices both stage exactly the
layer files the KV describes and stream the engine's tokens; a foreign fingerprint is
FAILED_PRECONDITION; a short tile, a missing block, a missing metadata block and malformed
wire are INVALID_ARGUMENT; KV over the staging bound is RESOURCE_EXHAUSTED; an engine failure
after staging ends the RPC with its status. After every case the staging root holds nothing
but engine.json.

A stub decode engine (aiohttp on loopback, in this process) plays SidecarKVConnector's load:
it reads the staged layer files of the key it is given and records them.

Does not prove: real vLLM loading the staged KV (tests/real_vllm/test_inline_kv.py does).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
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
    write_atomic,
)
from inline_kv.inline_builders import layer_blocks
from sidecar.config.settings import KVTransport
from sidecar.grpc_gen import disagg_pb2, disagg_pb2_grpc
from sidecar.grpc_server.inline.protowire import frame_decode_request, kv_block_of_stream
from sidecar.grpc_server.inline.wire import meta_block

LAYOUT = InlineLayout(
    dtype="float32", block_size=4, num_kv_heads=2, head_size=8, num_layers=3, fingerprint="f0"
)
PROMPT = list(range(100, 110))  # 10 tokens: 3 blocks of 4
META = InlineMeta(LAYOUT, num_tokens=len(PROMPT), num_blocks=3, key="p-1")
TOKENS = [7, 8]


def layer_bytes(layer: int) -> bytes:
    return bytes((layer * 41 + i * 7) % 253 for i in range(META.num_blocks * LAYOUT.block_bytes))


def kv_blocks(meta: InlineMeta = META) -> list[disagg_pb2.KVBlock]:
    out = [meta_block("r", meta)]
    for layer in range(LAYOUT.num_layers):
        out += layer_blocks("r", META, layer, layer_bytes(layer))
    return out


def request(blocks: list[disagg_pb2.KVBlock]) -> disagg_pb2.DecodeRequest:
    return disagg_pb2.DecodeRequest(
        request_id="r", kv_blocks=blocks, token_ids=PROMPT, max_new_tokens=len(TOKENS)
    )


@dataclass
class LoadEngine:
    """Loads staged KV as the connector would; ``status`` != 200 fails after reading it."""

    root: Path
    status: int = 200
    loaded: list[dict[int, bytes]] = field(default_factory=list)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = await request.json()
        directory = self.root / body["kv_transfer_params"]["disagg_inline"]["key"]
        meta = InlineMeta.from_json((directory / META_FILE).read_bytes())
        assert body["prompt"] == PROMPT and meta.num_tokens == len(PROMPT)
        self.loaded.append(
            {i: (directory / layer_file(i)).read_bytes() for i in range(LAYOUT.num_layers)}
        )
        if self.status != 200:
            return web.json_response({"error": "boom"}, status=self.status)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, token in enumerate(TOKENS):
            last = i == len(TOKENS) - 1
            chunk = {"choices": [{"index": 0, "text": "a", "token_ids": [token],
                                  "finish_reason": "length" if last else None}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@pytest.fixture
def root() -> Iterator[Path]:
    shm = Path("/dev/shm")
    path = Path(tempfile.mkdtemp(prefix="kvd-", dir=shm if shm.is_dir() else None))
    write_atomic(path / ENGINE_FILE, json.dumps(LAYOUT.to_dict()).encode())
    yield path
    shutil.rmtree(path, ignore_errors=True)


@contextlib.asynccontextmanager
async def decode_side(
    root: Path, **overrides: Any
) -> AsyncIterator[tuple[LoadEngine, GrpcSidecar]]:
    engine = LoadEngine(root)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", engine.completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        async with grpc_sidecar(
            f"http://127.0.0.1:{runner.addresses[0][1]}",
            engine="vllm",
            kv_connector="shfs",
            role="decode",
            kv_transport=KVTransport.INLINE,
            kv_staging_dir=str(root),
            **overrides,
        ) as side:
            yield engine, side
    finally:
        await runner.cleanup()
    assert leftovers(root) == []


def leftovers(root: Path) -> list[str]:
    """Everything in the staging root but the engine's own engine.json."""
    return sorted(p.name for p in root.iterdir() if p.name != ENGINE_FILE)


async def decode(side: GrpcSidecar, message: disagg_pb2.DecodeRequest | bytes) -> list[int]:
    """Tokens of a Decode call (``bytes``: sent as they are, as a framing router does)."""
    async with grpc.aio.insecure_channel(side.address, options=CHANNEL_OPTIONS) as channel:
        stream: grpc.aio.UnaryStreamCall[Any, disagg_pb2.TokenStream]
        if isinstance(message, bytes):
            raw: grpc.aio.UnaryStreamMultiCallable[bytes, disagg_pb2.TokenStream]
            raw = channel.unary_stream(
                "/disagg.DecodeWorker/Decode",
                request_serializer=None,
                response_deserializer=disagg_pb2.TokenStream.FromString,
            )
            stream = raw(message)
        else:
            stream = disagg_pb2_grpc.DecodeWorkerStub(channel).Decode(message)
        return [m.token_id async for m in stream if not m.done]


async def refused(side: GrpcSidecar, message: disagg_pb2.DecodeRequest | bytes) -> grpc.StatusCode:
    return (await refusal(side, message))[0]


async def refusal(
    side: GrpcSidecar, message: disagg_pb2.DecodeRequest | bytes
) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await decode(side, message)
    code: grpc.StatusCode = exc.value.code()
    return code, exc.value.details() or ""


def router_framed(blocks: list[disagg_pb2.KVBlock]) -> bytes:
    """What a router that forwards blocks opaquely sends: the request's other fields, then
    each block sliced out of its KVBlockStream message as field 2."""
    sliced = [
        kv_block_of_stream(disagg_pb2.KVBlockStream(block=block).SerializeToString())
        for block in blocks
    ]
    assert all(part is not None for part in sliced)
    return frame_decode_request(
        request([]).SerializeToString(), [part for part in sliced if part is not None]
    )


async def test_generated_client_and_router_framing_stage_the_same_files(root: Path) -> None:
    async with decode_side(root) as (engine, side):
        assert await decode(side, request(kv_blocks())) == TOKENS
        assert await decode(side, router_framed(list(reversed(kv_blocks())))) == TOKENS
        per_request = len(META.to_json()) + LAYOUT.num_layers * META.num_blocks * LAYOUT.block_bytes
        assert side.metric("disagg_kv_bytes_total", direction="in") == 2 * per_request
    expected = {i: layer_bytes(i) for i in range(LAYOUT.num_layers)}
    assert engine.loaded == [expected, expected]


async def test_foreign_fingerprint_is_failed_precondition(root: Path) -> None:
    foreign = InlineMeta(
        InlineLayout("float32", 4, 2, 8, 3, "another-model"), len(PROMPT), 3, "p-1"
    )
    async with decode_side(root) as (engine, side):
        code = await refused(side, request(kv_blocks(foreign)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and engine.loaded == []


BAD_BLOCKS = {
    "short-tile": lambda b: [
        *b[:-1], disagg_pb2.KVBlock(layer_idx=2, block_idx=2, k_data=b"x", v_data=b"y")
    ],
    "missing-block": lambda b: b[:-1],
    "no-metadata": lambda b: b[1:],
    "negative-layer": lambda b: [*b, disagg_pb2.KVBlock(layer_idx=-7)],
}


@pytest.mark.parametrize("mutate", BAD_BLOCKS.values(), ids=BAD_BLOCKS.keys())
async def test_bad_blocks_are_invalid_argument(root: Path, mutate: Any) -> None:
    async with decode_side(root) as (engine, side):
        assert await refused(side, request(mutate(kv_blocks()))) == grpc.StatusCode.INVALID_ARGUMENT
    assert engine.loaded == []


@pytest.mark.parametrize(
    "wire",
    [b"\x80", b"\x12\x05ab", request(kv_blocks()).SerializeToString()[:-3], b"\x12\x02\x00\x01"],
    ids=["truncated-key", "length-past-end", "truncated-request", "block-field-zero"],
)
async def test_malformed_wire_is_invalid_argument(root: Path, wire: bytes) -> None:
    async with decode_side(root) as (_, side):
        code, details = await refusal(side, wire)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in details
        # The sidecar still serves: a malformed request leaves nothing behind.
        assert await decode(side, request(kv_blocks())) == TOKENS


async def test_over_the_staging_bound_is_resource_exhausted(root: Path) -> None:
    async with decode_side(root, max_staged_bytes=META.num_blocks * LAYOUT.block_bytes) as (
        engine,
        side,
    ):
        code = await refused(side, request(kv_blocks()))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and engine.loaded == []


async def test_engine_failure_after_staging_cleans_up(root: Path) -> None:
    async with decode_side(root) as (engine, side):
        engine.status = 500
        assert await refused(side, request(kv_blocks())) != grpc.StatusCode.OK
        assert len(engine.loaded) == 1  # it was staged, then removed (checked on exit)
