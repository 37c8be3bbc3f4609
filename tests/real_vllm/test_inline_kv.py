"""Real vLLM engines (CPU) with this project's SidecarKVConnector, KV bytes through gRPC.

Proves: a prefill sidecar (``--kv-transport inline``) streams its engine's real KV cache
(metadata block, then per layer one KV block per run of ``RUN_PAGES`` engine pages, the
last run of a layer shorter); a test router collects the blocks and calls Decode on a
decode sidecar, whose engine loads them and streams exactly the greedy tokens the engine
gives without disaggregation, for prompts of several blocks, several requests at once; the
same decode sidecar gives the same tokens from page-sized blocks (``kv_block_bytes`` below
one page, the stream of earlier versions). Corrupting one block's bytes changes the output
(the KV really is used).
Blocks claiming another model configuration are refused (FAILED_PRECONDITION), missing blocks
are INVALID_ARGUMENT, KV over the staging bound is RESOURCE_EXHAUSTED, and after every case
no staged KV is left on either side. The layers stream while the engine computes: with the
engine's answer held back by a proxy until the router has a KV block, the router still gets
blocks (sent on the real connector's layer notices) and the decode still equals the baseline.

The engines are this module's own pair; vLLM loads ``connectors.sidecar_kv`` from the
connector's own package, installed into the engine environment by setup_env.sh (no
PYTHONPATH, no ``sidecar`` importable there: ``test_the_engines_load_the_connector_package``);
the reference output comes from the prefill engine itself, asked without any KV parameters.
Does not prove: another real model (the foreign configuration is
a forged metadata block), GPU attention layouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import struct
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web

from connectors.inline_layout import InlineLayout, read_engine_layout
from real_vllm.client import post_json
from real_vllm.harness import SERVED_MODEL_NAME, EngineEnv, EngineGroup, EngineSpec
from sidecar.config.settings import KVTransport, Role, Settings
from sidecar.grpc_gen import disagg_pb2, disagg_pb2_grpc
from sidecar.grpc_server.server import start_grpc_server
from sidecar.runtime import open_runtime

REPO = Path(__file__).resolve().parents[2]
MAX_NEW_TOKENS = 12
PROMPT_LENGTHS = (70, 100, 129)  # 3, 4 and 5 blocks of 32 tokens
#: Engine pages per streamed KV block: 3, 4 and 5 pages make one full run, a full run and a
#: run of one, a full run and a run of two.
RUN_PAGES = 3
#: One page per KV block: the stream of earlier versions.
PAGE_SIZED = 1


def connector_config(staging: Path) -> dict[str, Any]:
    return {
        "kv_connector": "SidecarKVConnector",
        "kv_connector_module_path": "connectors.sidecar_kv",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"staging_dir": str(staging)},
    }


class InlinePair:
    def __init__(self, prefill: str, decode: str, prefill_dir: Path, decode_dir: Path) -> None:
        self.prefill = prefill
        self.decode = decode
        self.prefill_dir = prefill_dir
        self.decode_dir = decode_dir


@pytest.fixture(scope="module")
def inline_pair(engine_env: EngineEnv) -> Iterator[InlinePair]:
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="inline-kv-", dir=shm) as tmp:
        prefill_dir, decode_dir = Path(tmp) / "prefill", Path(tmp) / "decode"
        # No PYTHONPATH: vLLM imports connectors.sidecar_kv from the connector's package.
        with EngineGroup(engine_env) as group:
            group.start(
                [
                    EngineSpec("inline-prefill", connector_config(prefill_dir), cpu=0),
                    EngineSpec(
                        "inline-decode",
                        connector_config(decode_dir),
                        cpu=1,
                        prefix_caching=False,
                    ),
                ]
            )
            yield InlinePair(
                group.engines["inline-prefill"].url,
                group.engines["inline-decode"].url,
                prefill_dir,
                decode_dir,
            )


def test_the_engines_load_the_connector_package(engine_env: EngineEnv, tmp_path: Path) -> None:
    """The engine environment has the connector's own distribution (connectors/pyproject.toml)
    and not the sidecar: ``connectors.sidecar_kv`` resolves to its site-packages, as the
    engines (started without PYTHONPATH, outside the repository) import it, with the files of
    this checkout; ``sidecar`` and the sidecar's pinned dependencies are not importable."""
    probe = (
        "import importlib.util as u, importlib.metadata as m, json\n"
        "spec = u.find_spec('connectors.sidecar_kv')\n"
        "print(json.dumps({'origin': spec.origin,"
        " 'sidecar': u.find_spec('sidecar') is not None,"
        " 'dists': sorted(d.metadata['Name'].lower() for d in m.distributions())}))\n"
    )
    answer = subprocess.run([str(engine_env.python), "-c", probe], cwd=tmp_path, env={
        "PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path)},
        capture_output=True, text=True, check=True, timeout=60)
    found = json.loads(answer.stdout)
    origin = Path(found["origin"])
    assert origin.is_relative_to(engine_env.root), origin
    assert "site-packages" in origin.parts
    assert found["sidecar"] is False
    assert "disagg-sidecar-connectors" in found["dists"]
    assert "disagg-sidecar" not in found["dists"]
    for module in ("sidecar_kv.py", "inline_layout.py", "__init__.py"):
        installed = (origin.parent / module).read_bytes()
        assert installed == (REPO / "connectors" / module).read_bytes(), (
            f"the engine environment's {module} is stale: run tests/real_vllm/setup_env.sh")


@contextlib.asynccontextmanager
async def sidecar(
    engine_url: str,
    role: str,
    staging: Path,
    max_staged_bytes: int = 1 << 30,
    pages_per_block: int = RUN_PAGES,
) -> AsyncIterator[str]:
    # The engine's connector published its layout at start-up: one page's K+V bytes.
    page_bytes = read_engine_layout_or_fail(staging).block_bytes
    settings = Settings(
        engine="vllm",
        kv_connector="shfs",
        engine_url=engine_url,
        role=Role(role),
        host="127.0.0.1",
        port=0,
        grpc_port=0,
        advertise_host="127.0.0.1",
        log_level="warning",
        kv_transport=KVTransport.INLINE,
        kv_staging_dir=str(staging),
        max_staged_bytes=max_staged_bytes,
        kv_block_bytes=pages_per_block * page_bytes,
    )
    async with open_runtime(settings) as runtime:
        await runtime.health.check()
        port, stop = await start_grpc_server(runtime)
        try:
            yield f"127.0.0.1:{port}"
        finally:
            await stop(1.0)


def read_engine_layout_or_fail(staging: Path) -> InlineLayout:
    layout = read_engine_layout(staging)
    assert layout is not None, f"no engine.json in {staging}"
    return layout


def data_blocks_per_layer(length: int) -> int:
    pages = -(-length // 32)
    return -(-pages // RUN_PAGES)


def prompt(length: int, salt: int) -> list[int]:
    return [5 + (i * 37 + salt * 101) % 2000 for i in range(length)]


def baseline(engine: str, token_ids: list[int]) -> list[int]:
    body = {
        "model": SERVED_MODEL_NAME,
        "prompt": token_ids,
        "max_tokens": MAX_NEW_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }
    choice = post_json(engine + "/v1/completions", body)["choices"][0]
    return [int(t) for t in choice["token_ids"]]


async def prefill_blocks(address: str, token_ids: list[int], rid: str) -> list[disagg_pb2.KVBlock]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = disagg_pb2_grpc.PrefillWorkerStub(channel)
        call = stub.Prefill(
            disagg_pb2.PreFillRequest(request_id=rid, token_ids=token_ids, max_new_tokens=1),
            timeout=120,
        )
        return [m.block async for m in call if m.HasField("block")]


async def decode(
    address: str, token_ids: list[int], blocks: list[disagg_pb2.KVBlock], rid: str
) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = disagg_pb2_grpc.DecodeWorkerStub(channel)
        call = stub.Decode(
            disagg_pb2.DecodeRequest(
                request_id=rid,
                kv_blocks=blocks,
                token_ids=token_ids,
                max_new_tokens=MAX_NEW_TOKENS,
                temperature=0.0,
            ),
            timeout=120,
        )
        return [m.token_id async for m in call if not m.done]


def staged(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_dir()) if directory.exists() else []


def forged_meta(blocks: list[disagg_pb2.KVBlock], **changes: Any) -> list[disagg_pb2.KVBlock]:
    meta = json.loads(blocks[0].k_data)
    meta.update(changes)
    first = disagg_pb2.KVBlock()
    first.CopyFrom(blocks[0])
    first.k_data = json.dumps(meta).encode()
    return [first, *blocks[1:]]


async def test_inline_kv_through_grpc_gives_the_baseline(inline_pair: InlinePair) -> None:
    prompts = [prompt(n, salt) for salt, n in enumerate(PROMPT_LENGTHS)]
    expected = [baseline(inline_pair.prefill, p) for p in prompts]
    async with (
        sidecar(inline_pair.prefill, "prefill", inline_pair.prefill_dir) as pre,
        sidecar(
            inline_pair.prefill, "prefill", inline_pair.prefill_dir, pages_per_block=PAGE_SIZED
        ) as pre_pages,
        sidecar(inline_pair.decode, "decode", inline_pair.decode_dir) as dec,
    ):

        async def one(i: int, token_ids: list[int], via: str) -> tuple[list[int], int]:
            blocks = await prefill_blocks(via, token_ids, f"inline-{i}")
            return await decode(dec, token_ids, blocks, f"inline-{i}"), len(blocks)

        results = await asyncio.gather(*(one(i, p, pre) for i, p in enumerate(prompts)))
        paged = await asyncio.gather(*(one(i, p, pre_pages) for i, p in enumerate(prompts)))
    for (tokens, nblocks), want, n in zip(results, expected, PROMPT_LENGTHS, strict=True):
        assert nblocks == 1 + 2 * data_blocks_per_layer(n)  # metadata + 2 layers x runs
        assert tokens == want
    for (tokens, nblocks), want, n in zip(paged, expected, PROMPT_LENGTHS, strict=True):
        assert nblocks == 1 + 2 * -(-n // 32)  # metadata + 2 layers x pages
        assert tokens == want
    assert staged(inline_pair.prefill_dir) == []
    assert staged(inline_pair.decode_dir) == []


async def test_corrupted_block_changes_output_and_foreign_kv_is_refused(
    inline_pair: InlinePair,
) -> None:
    token_ids = prompt(100, 7)
    want = baseline(inline_pair.prefill, token_ids)
    async with (
        sidecar(inline_pair.prefill, "prefill", inline_pair.prefill_dir) as pre,
        sidecar(inline_pair.decode, "decode", inline_pair.decode_dir) as dec,
        sidecar(
            inline_pair.decode, "decode", inline_pair.decode_dir, max_staged_bytes=1024
        ) as small,
    ):
        blocks = await prefill_blocks(pre, token_ids, "corrupt")
        assert await decode(dec, token_ids, blocks, "clean") == want

        corrupted = list(blocks)
        victim = disagg_pb2.KVBlock()
        victim.CopyFrom(blocks[1])  # layer 0, the run of pages 0-2
        victim.k_data = struct.pack("<f", 3.0) * (len(victim.k_data) // 4)
        corrupted[1] = victim
        assert await decode(dec, token_ids, corrupted, "corrupted") != want

        cases: list[tuple[str, list[disagg_pb2.KVBlock], grpc.StatusCode]] = [
            (
                "foreign",
                forged_meta(blocks, fingerprint="0" * 32),
                grpc.StatusCode.FAILED_PRECONDITION,
            ),
            ("dtype", forged_meta(blocks, dtype="float16"), grpc.StatusCode.INVALID_ARGUMENT),
            ("missing", blocks[:-1], grpc.StatusCode.INVALID_ARGUMENT),
        ]
        for name, bad, code in cases:
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await decode(dec, token_ids, bad, name)
            assert exc.value.code() == code, name
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await decode(small, token_ids, blocks, "too-big")
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert staged(inline_pair.prefill_dir) == []
    assert staged(inline_pair.decode_dir) == []


class HoldingProxy:
    """Between the prefill sidecar and the real prefill engine: forwards every request, but
    keeps the engine's answer to an inline save until ``release`` is set. The answer then
    reaches the sidecar only after the router has a block: what the router gets before, the
    sidecar streamed on the connector's layer notices alone."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.release = asyncio.Event()
        self.engine_answered = asyncio.Event()
        self.url = ""

    async def forward(self, request: web.Request) -> web.Response:
        raw = await request.read()
        saving = False
        if request.method == "POST" and raw:
            params = json.loads(raw).get("kv_transfer_params") or {}
            saving = (params.get("disagg_inline") or {}).get("action") == "save"
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with aiohttp.ClientSession() as session:
            async with session.request(
                request.method, self.engine + request.path_qs, data=raw or None, headers=headers
            ) as answer:
                body, status = await answer.read(), answer.status
                content_type = answer.headers.get("Content-Type", "application/json")
        if saving:
            self.engine_answered.set()
            async with asyncio.timeout(120):  # a guard: reached only if nothing streamed early
                await self.release.wait()
        return web.Response(body=body, status=status, headers={"Content-Type": content_type})


@contextlib.asynccontextmanager
async def holding_proxy(engine: str) -> AsyncIterator[HoldingProxy]:
    proxy = HoldingProxy(engine)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", proxy.forward)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    proxy.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield proxy
    finally:
        await runner.cleanup()


async def test_kv_blocks_reach_the_router_before_the_engine_answer(
    inline_pair: InlinePair,
) -> None:
    token_ids = prompt(129, 11)  # 5 blocks x 2 layers
    want = baseline(inline_pair.prefill, token_ids)
    async with (
        holding_proxy(inline_pair.prefill) as proxy,
        sidecar(proxy.url, "prefill", inline_pair.prefill_dir) as pre,
        sidecar(inline_pair.decode, "decode", inline_pair.decode_dir) as dec,
    ):
        blocks: list[disagg_pb2.KVBlock] = []
        early: list[disagg_pb2.KVBlock] = []
        async with grpc.aio.insecure_channel(pre) as channel:
            call = disagg_pb2_grpc.PrefillWorkerStub(channel).Prefill(
                disagg_pb2.PreFillRequest(request_id="early", token_ids=token_ids), timeout=120
            )
            async for message in call:
                if not message.HasField("block"):
                    continue
                blocks.append(message.block)
                if message.block.layer_idx >= 0 and not proxy.release.is_set():
                    early.append(message.block)
                    proxy.release.set()
        assert proxy.engine_answered.is_set()
        assert [b.layer_idx for b in early] == [0]  # layer 0, before the answer was let through
        assert [(b.layer_idx, b.block_idx) for b in blocks[1:]] == [
            (layer, j) for layer in range(2) for j in range(data_blocks_per_layer(129))
        ]
        assert await decode(dec, token_ids, blocks, "early") == want
    assert staged(inline_pair.prefill_dir) == []
    assert not list(inline_pair.prefill_dir.glob(".*.notify"))  # notice sockets removed too
    assert staged(inline_pair.decode_dir) == []
