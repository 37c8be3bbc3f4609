"""Inline KV blocks: the metadata control block (``layer_idx == -2``) and the data blocks.

Prefill side: ``meta_block`` is the stream's first block; the data blocks are built from the
engine's layer files (``prefill_files``). Decode side: ``parse_blocks`` (``parse_entries`` for
blocks walked off the wire by ``protowire``) reassembles and checks a ``DecodeRequest``'s
blocks: INVALID_ARGUMENT for anything malformed, RESOURCE_EXHAUSTED past ``max_kv_blocks``;
``check_compatible`` refuses KV of another model, dtype or shape than the local engine's
(FAILED_PRECONDITION).

The encoding (metadata keys, pages and runs) and every decode rule: protos/README.md
("layer_idx -2"). A client controls the metadata: a document nested past the parser's
recursion limit and counts beyond 64 bits are INVALID_ARGUMENT too. Deliberate limit: the
metadata fits one block (a few hundred bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from connectors.inline_layout import InlineLayout, InlineMeta, LayoutError
from sidecar.errors import FailedPrecondition, InvalidRequest, ResourceExhausted, Stage
from sidecar.grpc_gen import disagg_pb2
from sidecar.grpc_server.layers import INLINE_META_LAYER


def meta_block(request_id: str, meta: InlineMeta) -> disagg_pb2.KVBlock:
    return disagg_pb2.KVBlock(
        request_id=request_id, layer_idx=INLINE_META_LAYER, block_idx=0, k_data=meta.to_json()
    )


#: A tile as received: its own bytes (parsed messages) or a view into the request (wire walk).
Tile = bytes | memoryview
#: One block as ``parse_entries`` takes it: (layer_idx, block_idx, k_data, v_data).
Entry = tuple[int, int, Tile, Tile]


@dataclass(frozen=True)
class InlineKV:
    """A request's KV as the decode side received it: ``tiles[layer][block] = (k, v)``, one
    entry per data block (``meta.run_pages(block)`` pages: K tiles back to back, V tiles)."""

    meta: InlineMeta
    tiles: list[list[tuple[Tile, Tile]]]
    #: ``k_data`` + ``v_data`` bytes of all the blocks received, the metadata block included.
    wire_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return self.meta.layout.num_layers * self.meta.num_blocks * self.meta.layout.block_bytes

    def layer_bytes(self, layer_idx: int) -> bytes:
        """One layer in the file layout of ``connectors.inline_layout``."""
        return b"".join(self.layer_chunks(layer_idx))

    def layer_chunks(self, layer_idx: int) -> list[Tile]:
        """The same, as the page tiles in file order (K, V per page): views into the blocks,
        written without joining (no copy)."""
        tile = self.meta.layout.tile_bytes
        chunks: list[Tile] = []
        for k_run, v_run in self.tiles[layer_idx]:
            if len(k_run) == tile:  # one page: the block's own K and V
                chunks += (k_run, v_run)
                continue
            k_view, v_view = memoryview(k_run), memoryview(v_run)
            for offset in range(0, len(k_view), tile):
                chunks += (k_view[offset : offset + tile], v_view[offset : offset + tile])
        return chunks


def _bad(message: str) -> InvalidRequest:
    return InvalidRequest(f"inline KV: {message}", stage=Stage.HANDOFF)


def parse_blocks(blocks: Sequence[disagg_pb2.KVBlock], *, max_blocks: int) -> InlineKV:
    """Reassemble and check the inline KV of a DecodeRequest (see the module docstring)."""
    # Each field read once: a protobuf bytes field is copied out on every access.
    return parse_entries(
        [(b.layer_idx, b.block_idx, b.k_data, b.v_data) for b in blocks], max_blocks=max_blocks
    )


def parse_entries(entries: Sequence[Entry], *, max_blocks: int) -> InlineKV:
    """``parse_blocks`` on blocks already taken apart (``protowire``)."""
    metas = [e for e in entries if e[0] == INLINE_META_LAYER]
    if len(metas) != 1:
        raise _bad(f"expected one metadata block (layer_idx -2), got {len(metas)}")
    _, meta_idx, meta_json, meta_v = metas[0]
    if meta_idx != 0 or len(meta_v):
        raise _bad("the metadata block must have block_idx 0 and empty v_data")
    try:
        meta = InlineMeta.from_json(bytes(meta_json))
    except LayoutError as exc:
        raise _bad(str(exc)) from None
    except RecursionError:
        # The standard library's parser recurses per level: a client's 5,000-deep document.
        raise _bad("the metadata block nests too deeply to be metadata") from None
    layout = meta.layout
    runs = meta.runs_per_layer
    expected = layout.num_layers * runs
    if expected > max_blocks:
        raise ResourceExhausted(
            f"inline KV has {expected} blocks; this sidecar accepts {max_blocks} per request",
            stage=Stage.HANDOFF)
    tiles: list[list[tuple[Tile, Tile] | None]] = [
        [None] * runs for _ in range(layout.num_layers)
    ]
    tile = layout.tile_bytes
    num_layers = layout.num_layers
    # Every block carries pages_per_block pages but a layer's last, which carries the rest.
    full_run = meta.pages_per_block * tile
    # Counted, not ``len(meta.run_pages(...))``: a client's counts may exceed what a range's
    # length can hold (2**64 pages), and every size must then simply fail to match.
    last_run = (meta.num_blocks - (runs - 1) * meta.pages_per_block) * tile
    for layer_idx, block_idx, k_data, v_data in entries:
        if layer_idx == INLINE_META_LAYER:
            continue
        if layer_idx < 0:
            raise _bad(f"unexpected control block layer_idx {layer_idx}")
        if layer_idx >= num_layers or not 0 <= block_idx < runs:
            raise _bad(f"block ({layer_idx}, {block_idx}) is outside the metadata")
        size = last_run if block_idx == runs - 1 else full_run
        if len(k_data) != size or len(v_data) != size:
            raise _bad(
                f"block ({layer_idx}, {block_idx}) has K/V of "
                f"{len(k_data)}/{len(v_data)} bytes, expected {size}"
            )
        row = tiles[layer_idx]
        if row[block_idx] is not None:
            raise _bad(f"block ({layer_idx}, {block_idx}) is duplicated")
        row[block_idx] = (k_data, v_data)
    missing = [(li, bi) for li, row in enumerate(tiles) for bi, t in enumerate(row) if t is None]
    if missing:
        raise _bad(f"{len(missing)} of {expected} blocks are missing, first {missing[0]}")
    full = [[t for t in row if t is not None] for row in tiles]
    kv_bytes = num_layers * meta.num_blocks * 2 * tile
    return InlineKV(meta=meta, tiles=full, wire_bytes=len(meta_json) + kv_bytes)


def check_compatible(meta: InlineMeta, engine: InlineLayout | None) -> None:
    """FAILED_PRECONDITION unless the KV fits the local engine exactly."""
    if engine is None:
        raise _unfit("the local engine has not published its KV layout (engine.json in the "
                     "staging directory): is it running SidecarKVConnector?")
    got = meta.layout
    if got.fingerprint != engine.fingerprint:
        raise _unfit(f"inline KV comes from another model/config (fingerprint "
                     f"{got.fingerprint}, local engine {engine.fingerprint})")
    if got != engine:
        raise _unfit(f"inline KV layout {got} does not match the local engine's {engine}")


def _unfit(message: str) -> FailedPrecondition:
    return FailedPrecondition(message, stage=Stage.HANDOFF)
