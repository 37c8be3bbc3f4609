"""Proves the in-place message building of the prefill side (``inline.filled``).

- ``filled_bytes`` returns real ``bytes`` holding exactly what ``fill`` wrote, in place (CPython)
  and through a ``bytearray`` alike; an empty message is ``b""`` and ``fill`` is not called.
- ``preadv_exactly`` reads a file region into many views in order (more than ``IOV_MAX`` of
  them: several calls) and raises ``EOFError`` when the file ends first.
- A layer read into place gives the same messages as framing slices of the file
  (``frame_stream_block``), runs of one page, several pages and the layer's shorter last one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from connectors.inline_layout import InlineLayout, InlineMeta, layer_file
from sidecar.grpc_server.inline.filled import IOV_MAX, filled_bytes, preadv_exactly
from sidecar.grpc_server.inline.prefill_files import read_layer_messages
from sidecar.grpc_server.inline.protowire import frame_stream_block

LAYOUT = InlineLayout(
    dtype="float16", block_size=2, num_kv_heads=1, head_size=4, num_layers=2, fingerprint="f"
)


@pytest.mark.parametrize("in_place", [True, False])
def test_filled_bytes_are_bytes_holding_what_fill_wrote(in_place: bool) -> None:
    def fill(view: memoryview) -> None:
        view[:3] = b"abc"
        view[3:] = bytes(i % 256 for i in range(len(view) - 3))

    made = filled_bytes(300, fill, in_place=in_place)
    expected = b"abc" + bytes(i % 256 for i in range(297))
    assert type(made) is bytes
    assert made == expected
    assert hash(made) == hash(expected)
    assert {made: 1}[expected] == 1


def test_an_empty_message_is_not_filled() -> None:
    def fill(_: memoryview) -> None:
        raise AssertionError("called")

    assert filled_bytes(0, fill) == b""


def test_preadv_exactly_fills_views_in_order(tmp_path: Path) -> None:
    data = bytes(i % 251 for i in range(3 * IOV_MAX))
    path = tmp_path / "f"
    path.write_bytes(data)
    target = bytearray(len(data) - 10)
    with memoryview(target) as view:
        views = [view[i : i + 2] for i in range(0, len(view), 2)]  # over IOV_MAX buffers
        fd = os.open(path, os.O_RDONLY)
        try:
            preadv_exactly(fd, views, 10)
            with pytest.raises(EOFError):
                preadv_exactly(fd, [memoryview(bytearray(20))], len(data) - 5)
        finally:
            os.close(fd)
        del views
    assert bytes(target) == data[10:]


@pytest.mark.parametrize("pages_per_block", [1, 2, 5])
def test_a_layer_read_in_place_is_the_framed_layer(tmp_path: Path, pages_per_block: int) -> None:
    meta = InlineMeta(LAYOUT, num_tokens=9, num_blocks=5, key="p-1",
                      pages_per_block=pages_per_block)
    tile = LAYOUT.tile_bytes
    data = bytes((i * 7) % 253 for i in range(5 * LAYOUT.block_bytes))
    (tmp_path / layer_file(1)).write_bytes(data)
    framed = [
        frame_stream_block(
            "r-1", 1, run,
            [data[2 * p * tile : (2 * p + 1) * tile] for p in meta.run_pages(run)],
            [data[(2 * p + 1) * tile : (2 * p + 2) * tile] for p in meta.run_pages(run)],
        )
        for run in range(meta.runs_per_layer)
    ]
    assert [m for m, _ in read_layer_messages("r-1", meta, tmp_path, 1)] == framed
