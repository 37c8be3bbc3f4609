"""Proves the inline-KV codec and staging area without vLLM: blocks round-trip to the
connector's file layout, every malformed or foreign stream is refused with the right status,
the staging bound is enforced with RESOURCE_EXHAUSTED, and nothing staged survives a request
that ends, fails or is cancelled."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest

from connectors.inline_layout import (
    META_FILE,
    InlineLayout,
    InlineMeta,
    LayoutError,
    check_key,
    layer_file,
)
from inline_kv.inline_builders import layer_blocks
from sidecar.errors import SidecarError
from sidecar.grpc_gen import disagg_pb2
from sidecar.grpc_server.errors import grpc_status
from sidecar.grpc_server.inline.prefill_files import read_layer_messages, read_staged_meta
from sidecar.grpc_server.inline.staging import StagingArea
from sidecar.grpc_server.inline.wire import check_compatible, meta_block, parse_blocks
from sidecar.observability.metrics import Metrics

LAYOUT = InlineLayout(
    dtype="float32", block_size=4, num_kv_heads=2, head_size=8, num_layers=3, fingerprint="f0"
)
META = InlineMeta(LAYOUT, num_tokens=10, num_blocks=3, key="p-1")


def layer_data(layer: int) -> bytes:
    size = META.num_blocks * LAYOUT.block_bytes
    return bytes((layer * 31 + i) % 251 for i in range(size))


def stream() -> list[disagg_pb2.KVBlock]:
    blocks = [meta_block("r", META)]
    for layer in range(LAYOUT.num_layers):
        blocks += layer_blocks("r", META, layer, layer_data(layer))
    return blocks


def status_of(exc: pytest.ExceptionInfo[SidecarError]) -> grpc.StatusCode:
    return grpc_status(exc.value)


def test_round_trip_to_file_layout() -> None:
    blocks = stream()
    assert len(blocks) == 1 + 3 * 3
    kv = parse_blocks(list(reversed(blocks)), max_blocks=100)
    assert kv.meta == META
    for layer in range(3):
        assert kv.layer_bytes(layer) == layer_data(layer)


def test_prefill_side_reads_engine_files(tmp_path: Path) -> None:
    (tmp_path / META_FILE).write_bytes(META.to_json())
    (tmp_path / layer_file(0)).write_bytes(layer_data(0))
    assert read_staged_meta(tmp_path) == META
    read = [
        disagg_pb2.KVBlockStream.FromString(message).block
        for message, _ in read_layer_messages("r", META, tmp_path, 0)
    ]
    assert read == layer_blocks("r", META, 0, layer_data(0))
    (tmp_path / layer_file(2)).write_bytes(layer_data(2)[:-1])
    for layer in (1, 2):
        with pytest.raises(SidecarError) as exc:
            read_layer_messages("r", META, tmp_path, layer)
        assert status_of(exc) == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(SidecarError) as exc:
        read_staged_meta(tmp_path / "nothing")
    assert status_of(exc) == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda b: b[1:], id="no-metadata"),
        pytest.param(lambda b: b[:-1], id="missing-block"),
        pytest.param(lambda b: [x for x in b if x.layer_idx != 2], id="missing-layer"),
        pytest.param(lambda b: [*b, b[3]], id="duplicate"),
        pytest.param(lambda b: [*b, b[0]], id="two-metadata"),
        pytest.param(
            lambda b: [
                *b[:-1],
                disagg_pb2.KVBlock(layer_idx=2, block_idx=2, k_data=b"x", v_data=b"y"),
            ],
            id="short-tile",
        ),
        pytest.param(
            lambda b: [*b, disagg_pb2.KVBlock(layer_idx=3, block_idx=0)], id="layer-outside"
        ),
        pytest.param(lambda b: [*b, disagg_pb2.KVBlock(layer_idx=-1)], id="handoff-block"),
        pytest.param(
            lambda b: [disagg_pb2.KVBlock(layer_idx=-2, k_data=b"{not json"), *b[1:]],
            id="bad-json",
        ),
    ],
)
def test_malformed_streams_are_invalid_argument(mutate: object) -> None:
    assert callable(mutate)
    with pytest.raises(SidecarError) as exc:
        parse_blocks(mutate(stream()), max_blocks=100)
    assert status_of(exc) == grpc.StatusCode.INVALID_ARGUMENT


def _meta_json(**overrides: object) -> bytes:
    return json.dumps({**META.to_dict(), **overrides}).encode()


@pytest.mark.parametrize(
    "meta",
    [
        pytest.param(b"[" * 5000 + b"]" * 5000, id="nested-5000"),
        pytest.param(b'{"a": ' * 6000 + b"1" + b"}" * 6000, id="nested-objects-6000"),
        pytest.param(_meta_json(num_tokens=2**64, block_size=1, num_blocks=2**64,
                                pages_per_block=2**64), id="counts-2^64"),
        pytest.param(_meta_json(num_tokens=2**70, block_size=1, num_blocks=2**70,
                                pages_per_block=2**69), id="counts-2^70"),
        pytest.param(_meta_json(num_kv_heads=2**64), id="heads-2^64"),
    ],
)
def test_hostile_metadata_is_invalid_argument(meta: bytes) -> None:
    blocks = [disagg_pb2.KVBlock(layer_idx=-2, k_data=meta), *stream()[1:]]
    with pytest.raises(SidecarError) as exc:
        parse_blocks(blocks, max_blocks=100)
    assert status_of(exc) in (grpc.StatusCode.INVALID_ARGUMENT,
                              grpc.StatusCode.RESOURCE_EXHAUSTED)


def test_too_many_blocks_is_resource_exhausted() -> None:
    with pytest.raises(SidecarError) as exc:
        parse_blocks(stream(), max_blocks=8)
    assert status_of(exc) == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_foreign_config_is_failed_precondition() -> None:
    check_compatible(META, LAYOUT)
    foreign = [
        None,
        InlineLayout("float32", 4, 2, 8, 3, "other-model"),
        InlineLayout("float32", 4, 2, 16, 3, "f0"),
        InlineLayout("float16", 4, 2, 8, 3, "f0"),
    ]
    for engine in foreign:
        with pytest.raises(SidecarError) as exc:
            check_compatible(META, engine)
        assert status_of(exc) == grpc.StatusCode.FAILED_PRECONDITION


async def test_staging_writes_connector_layout_and_cleans_up(tmp_path: Path) -> None:
    area = StagingArea(tmp_path, max_bytes=10**6)
    kv = parse_blocks(stream(), max_blocks=100)
    async with area.stage(kv) as key:
        directory = tmp_path / key
        staged = InlineMeta.from_json((directory / META_FILE).read_bytes())
        assert staged.key == key and staged.num_tokens == 10
        assert (directory / layer_file(1)).read_bytes() == layer_data(1)
        assert area.reserved_bytes == kv.nbytes
    assert area.staged_keys() == [] and area.reserved_bytes == 0


async def test_staging_tells_the_staged_bytes_gauge(tmp_path: Path) -> None:
    metrics = Metrics()
    area = StagingArea(tmp_path, max_bytes=10**6, on_change=metrics.staged_bytes.set)
    gauge = metrics.registry.get_sample_value
    kv = parse_blocks(stream(), max_blocks=100)
    assert gauge("disagg_staged_kv_bytes") == 0
    async with area.stage(kv):
        assert gauge("disagg_staged_kv_bytes") == kv.nbytes
    assert gauge("disagg_staged_kv_bytes") == 0


async def test_staging_cleans_up_after_failure(tmp_path: Path) -> None:
    area = StagingArea(tmp_path, max_bytes=10**6)
    kv = parse_blocks(stream(), max_blocks=100)
    with pytest.raises(RuntimeError):
        async with area.stage(kv):
            assert len(area.staged_keys()) == 1
            raise RuntimeError("decode failed")
    assert area.staged_keys() == [] and area.reserved_bytes == 0


async def test_staging_cleans_up_after_cancel(tmp_path: Path) -> None:
    area = StagingArea(tmp_path, max_bytes=10**6)
    kv = parse_blocks(stream(), max_blocks=100)
    entered = asyncio.Event()
    never = asyncio.Event()

    async def decode() -> None:
        async with area.stage(kv):
            entered.set()
            await never.wait()

    task = asyncio.ensure_future(decode())
    await entered.wait()
    assert len(area.staged_keys()) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert area.staged_keys() == [] and area.reserved_bytes == 0


async def test_a_stage_cancelled_while_writing_waits_for_its_writer_then_cleans_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer thread cannot be cancelled: removing the directory while it still wrote
    left the files it wrote afterwards on the volume."""
    import threading

    kv = parse_blocks(stream(), max_blocks=100)
    area = StagingArea(tmp_path, max_bytes=1 << 30)
    writing, release, written = threading.Event(), threading.Event(), threading.Event()
    write = StagingArea._write

    def slow_write(directory: Path, kv: object, key: str) -> None:
        writing.set()
        release.wait(10)
        try:
            write(directory, kv, key)  # type: ignore[arg-type]
        finally:
            written.set()

    monkeypatch.setattr(StagingArea, "_write", staticmethod(slow_write))

    async def decode() -> None:
        async with area.stage(kv):
            pass  # pragma: no cover (cancelled while writing)

    task = asyncio.ensure_future(decode())
    assert await asyncio.to_thread(writing.wait, 10)
    task.cancel()
    await asyncio.sleep(0)  # the cancellation is delivered while the thread writes
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert written.is_set()  # the stage ended after its writer, not before
    assert await asyncio.to_thread(written.wait, 10)
    assert area.staged_keys() == [] and area.reserved_bytes == 0


async def test_staging_bound_is_resource_exhausted(tmp_path: Path) -> None:
    kv = parse_blocks(stream(), max_blocks=100)
    area = StagingArea(tmp_path, max_bytes=kv.nbytes + kv.nbytes // 2)
    async with area.stage(kv):
        with pytest.raises(SidecarError) as exc:
            async with area.stage(kv):
                pass  # pragma: no cover
        assert status_of(exc) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert len(area.staged_keys()) == 1
    async with area.stage(kv):
        pass
    assert area.staged_keys() == [] and area.reserved_bytes == 0


@pytest.mark.parametrize("key", ["../x", "a/b", "", ".hidden", "x" * 129, "a b", "key\n"])
def test_unsafe_keys_are_refused(key: str) -> None:
    with pytest.raises(LayoutError):
        check_key(key)


def test_metadata_must_be_consistent() -> None:
    doc = META.to_dict()
    assert InlineMeta.from_dict(doc) == META
    for change in (
        {"num_blocks": 2},
        {"version": 2},
        {"layout": "NHC"},
        {"dtype": "int4"},
        {"head_size": 0},
        {"key": "../etc"},
    ):
        with pytest.raises(LayoutError):
            InlineMeta.from_dict({**doc, **change})
