"""Proves KV blocks that carry runs of engine pages (``pages_per_block``, ``--kv-block-bytes``).

- The metadata document names ``pages_per_block`` only when it is not 1 (page-sized streams
  are what senders without the key sent); a missing key reads as 1; a key that is not a
  positive integer is refused.
- ``frame_stream_block`` gives exactly protobuf's bytes for the same KVBlockStream.
- The prefill side reads a layer file as runs: K tiles of the run's pages back to back in
  ``k_data``, V tiles in ``v_data``, the layer's last run shorter.
- The decode side maps runs back to the connector's page layout, and refuses runs of the
  wrong size, outside the metadata, duplicated or missing (INVALID_ARGUMENT) and more runs
  than ``max_kv_blocks`` (RESOURCE_EXHAUSTED).
- A run never outgrows the gRPC message limit, whatever ``kv_block_bytes`` says.
- End to end, on real sidecars and stub engines: one decode sidecar takes page-sized,
  two-page and whole-layer blocks from prefill sidecars of this one version (differing only
  in ``kv_block_bytes``), from a generated client and from a router that frames the
  request from the stream's slices, and stages the very bytes the prefill engine wrote.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from connectors.inline_layout import (
    ENGINE_FILE,
    PAGES_PER_BLOCK_KEY,
    InlineLayout,
    InlineMeta,
    LayoutError,
    layer_file,
    write_atomic,
)
from inline_kv.test_decode_wire import decode, decode_side, request, router_framed
from inline_kv.test_prefill_streaming import (
    KVEngine,
    inline_sidecar,
    kv_engine,
    layer_bytes,
    route,
)
from sidecar.config.settings import Settings
from sidecar.errors import SidecarError
from sidecar.grpc_gen import disagg_pb2
from sidecar.grpc_server.errors import grpc_status
from sidecar.grpc_server.inline.prefill_files import pages_per_block, read_layer_messages
from sidecar.grpc_server.inline.protowire import frame_stream_block
from sidecar.grpc_server.inline.wire import meta_block, parse_blocks

LAYOUT = InlineLayout(
    dtype="float32", block_size=4, num_kv_heads=2, head_size=8, num_layers=3, fingerprint="f0"
)
TILE = LAYOUT.tile_bytes
PAGES = 3  # 10 tokens at block size 4
RUNS2 = InlineMeta(LAYOUT, num_tokens=10, num_blocks=PAGES, key="p-1", pages_per_block=2)


def file_bytes(layer: int) -> bytes:
    return bytes((layer * 29 + i * 11) % 249 for i in range(PAGES * LAYOUT.block_bytes))


def run_blocks(meta: InlineMeta, data_of: dict[int, bytes]) -> list[disagg_pb2.KVBlock]:
    """The data blocks a prefill sends for ``meta``: per run, K tiles then V tiles."""
    blocks = []
    for layer, data in data_of.items():
        for run in range(meta.runs_per_layer):
            pages = meta.run_pages(run)
            blocks.append(disagg_pb2.KVBlock(
                request_id="r", layer_idx=layer, block_idx=run,
                k_data=b"".join(data[2 * p * TILE : (2 * p + 1) * TILE] for p in pages),
                v_data=b"".join(data[(2 * p + 1) * TILE : (2 * p + 2) * TILE] for p in pages),
            ))
    return blocks


def all_layers() -> dict[int, bytes]:
    return {layer: file_bytes(layer) for layer in range(LAYOUT.num_layers)}


def test_metadata_names_pages_per_block_only_when_not_one() -> None:
    pages = InlineMeta(LAYOUT, num_tokens=10, num_blocks=PAGES, key="p-1")
    assert PAGES_PER_BLOCK_KEY not in json.loads(pages.to_json())
    assert json.loads(RUNS2.to_json())[PAGES_PER_BLOCK_KEY] == 2
    assert InlineMeta.from_json(RUNS2.to_json()) == RUNS2
    assert InlineMeta.from_json(pages.to_json()).pages_per_block == 1
    assert (RUNS2.runs_per_layer, list(RUNS2.run_pages(0)), list(RUNS2.run_pages(1))) == (
        2, [0, 1], [2]
    )
    for bad in (0, -2, "2", True, 1.5, None):
        doc = {**json.loads(pages.to_json()), PAGES_PER_BLOCK_KEY: bad}
        with pytest.raises(LayoutError):
            InlineMeta.from_dict(doc)


def test_pages_per_block_fits_the_block_bytes() -> None:
    page = LAYOUT.block_bytes
    meta = InlineMeta(LAYOUT, num_tokens=400, num_blocks=100, key="p-1")
    sizes = (1, page - 1, page, 2 * page + 1, 100 * page, 10**9)
    assert [pages_per_block(meta, n) for n in sizes] == [1, 1, 1, 2, 100, 100]


@pytest.mark.parametrize(
    ("rid", "layer", "block", "k", "v"),
    [
        ("r-1", 0, 0, [b"ab", b"cd"], [b"ef"]),
        ("", 3, 700, [b"x" * 300], [memoryview(b"y" * 200)]),
        ("ü", -2, 0, [b"{}"], []),
        ("r", 2**31 - 1, 1, [], []),
    ],
)
def test_framed_stream_block_is_protobufs_bytes(
    rid: str, layer: int, block: int, k: list[bytes], v: list[bytes]
) -> None:
    message = disagg_pb2.KVBlockStream(block=disagg_pb2.KVBlock(
        request_id=rid, layer_idx=layer, block_idx=block,
        k_data=b"".join(bytes(p) for p in k), v_data=b"".join(bytes(p) for p in v),
    ))
    assert frame_stream_block(rid, layer, block, k, v) == message.SerializeToString()


def test_prefill_reads_a_layer_file_as_runs(tmp_path: Path) -> None:
    (tmp_path / layer_file(1)).write_bytes(file_bytes(1))
    messages = read_layer_messages("r", RUNS2, tmp_path, 1)
    blocks = [disagg_pb2.KVBlockStream.FromString(m).block for m, _ in messages]
    assert blocks == run_blocks(RUNS2, {1: file_bytes(1)})
    assert [n for _, n in messages] == [2 * LAYOUT.block_bytes, LAYOUT.block_bytes]


@pytest.mark.parametrize("ppb", [1, 2, 3, 50])
def test_decode_maps_runs_back_to_the_page_layout(ppb: int) -> None:
    meta = InlineMeta(LAYOUT, num_tokens=10, num_blocks=PAGES, key="p-1", pages_per_block=ppb)
    blocks = [meta_block("r", meta), *run_blocks(meta, all_layers())]
    kv = parse_blocks(list(reversed(blocks)), max_blocks=100)
    assert kv.meta == meta
    for layer, data in all_layers().items():
        assert kv.layer_bytes(layer) == data


def _cut(blocks: list[disagg_pb2.KVBlock], index: int, **changes: object) -> None:
    victim = disagg_pb2.KVBlock()
    victim.CopyFrom(blocks[index])
    for name, value in changes.items():
        setattr(victim, name, value)
    blocks[index] = victim


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda b: _cut(b, 1, k_data=b"\0" * TILE), id="full-run-one-page"),
        pytest.param(lambda b: _cut(b, 2, v_data=b"\0" * 2 * TILE), id="last-run-two-pages"),
        pytest.param(lambda b: _cut(b, 2, block_idx=2), id="run-outside"),
        pytest.param(lambda b: _cut(b, 2, block_idx=0), id="duplicated-run"),
        pytest.param(lambda b: b.pop(), id="missing-run"),
    ],
)
def test_bad_runs_are_invalid_argument(mutate: object) -> None:
    blocks = [meta_block("r", RUNS2), *run_blocks(RUNS2, all_layers())]
    assert callable(mutate)
    mutate(blocks)
    with pytest.raises(SidecarError) as exc:
        parse_blocks(blocks, max_blocks=100)
    assert grpc_status(exc.value) == grpc.StatusCode.INVALID_ARGUMENT


def test_runs_count_against_max_kv_blocks() -> None:
    blocks = [meta_block("r", RUNS2), *run_blocks(RUNS2, all_layers())]
    assert parse_blocks(blocks, max_blocks=6).meta == RUNS2  # 3 layers x 2 runs
    with pytest.raises(SidecarError) as exc:
        parse_blocks(blocks, max_blocks=5)
    assert grpc_status(exc.value) == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.fixture
def roots() -> Iterator[tuple[Path, Path]]:
    # Short on purpose: the notice socket's path must fit sun_path (pytest's tmp_path may not).
    shm = Path("/dev/shm")
    base = Path(tempfile.mkdtemp(prefix="kvr-", dir=shm if shm.is_dir() else None))
    pair = (base / "p", base / "d")
    for path in pair:
        path.mkdir()
        write_atomic(path / ENGINE_FILE, json.dumps(LAYOUT.to_dict()).encode())
    yield pair
    shutil.rmtree(base, ignore_errors=True)


async def _compute(engine: KVEngine, key: str) -> int:
    for layer in range(LAYOUT.num_layers):
        engine.write_layer(key, layer)
    engine.write_meta(key)
    return 200


async def test_one_decode_takes_page_and_run_sized_blocks_of_this_version(
    roots: tuple[Path, Path],
) -> None:
    prefill_root, decode_root = roots
    page = LAYOUT.block_bytes
    # kv_block_bytes -> pages per block, runs per layer (3 pages per layer).
    # The default, 2 MiB, is far more than a layer here: one block per layer.
    cases = [(page, 1, 3), (2 * page, 2, 2), (Settings().kv_block_bytes, PAGES, 1)]
    async with kv_engine(prefill_root, _compute) as engine, \
            decode_side(decode_root) as (loader, dec):
        for block_bytes, ppb, runs in cases:
            async with inline_sidecar(engine, kv_block_bytes=block_bytes) as pre:
                received = await route(pre.address)
            assert received.status == grpc.StatusCode.OK and received.done
            head, *data = received.blocks
            doc = json.loads(head.k_data)
            assert doc.get(PAGES_PER_BLOCK_KEY, 1) == ppb
            assert (PAGES_PER_BLOCK_KEY in doc) == (ppb != 1)
            assert [(b.layer_idx, b.block_idx) for b in data] == [
                (layer, j) for layer in range(LAYOUT.num_layers) for j in range(runs)
            ]
            assert await decode(dec, request(received.blocks)) == [7, 8]
            assert await decode(dec, router_framed(received.blocks)) == [7, 8]
    wrote = {i: layer_bytes(i) for i in range(LAYOUT.num_layers)}
    assert loader.loaded == [wrote] * (2 * len(cases))


async def test_runs_stay_within_the_grpc_message_limit(roots: tuple[Path, Path]) -> None:
    prefill_root, _ = roots
    # Room for two pages besides the 4 KiB kept for ids and framing, whatever kv_block_bytes.
    limit = 4096 + 2 * LAYOUT.block_bytes + 100
    async with kv_engine(prefill_root, _compute) as engine, inline_sidecar(
        engine, kv_block_bytes=1 << 20, grpc_max_message_bytes=limit
    ) as pre:
        received = await route(pre.address)
    assert received.status == grpc.StatusCode.OK and received.done
    head, *data = received.blocks
    assert json.loads(head.k_data)[PAGES_PER_BLOCK_KEY] == 2
    assert [len(b.k_data) // TILE for b in data] == [2, 1] * LAYOUT.num_layers
