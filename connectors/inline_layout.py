"""The inline-KV byte layout and the files that carry it between an engine and its sidecar.

Pure Python (no torch, no vLLM): both the KV connector inside the engine
(``connectors.sidecar_kv``) and the sidecar (``sidecar.inline_kv``) import it, so the two
sides agree on one definition.

Directory of one request, ``<staging_root>/<key>/``:

- ``layer-NNNN.kv`` per layer ``NNNN`` (0-based, 4 digits): ``num_blocks`` records back to
  back; record ``j`` is block ``j`` of the request (token ``j*block_size`` onwards): its K
  tile then its V tile. A tile is ``[num_kv_heads, block_size, head_size]`` of ``dtype``,
  C order, little-endian (layout name ``"HNC"``). ``tile_bytes`` is the size of one tile.
- ``meta.json``: the ``InlineMeta`` document, written last (atomically): its presence says
  every layer file is complete.

The staging root also holds ``engine.json`` (an ``InlineLayout`` document), written by the
connector of the engine at start-up: a sidecar validates incoming KV against it, and a
prefill sidecar announces its metadata from it before the engine has computed anything.

Layer notices: while a prefill sidecar waits for request ``key``, it binds a Unix datagram
socket at ``<staging_root>/.<key>.notify`` (``notice_path``; the leading dot keeps it apart
from every key directory). After writing (atomically) ``layer-NNNN.kv`` the connector sends
one datagram ``b"<key> <layer>"`` there (``send_notice``), best effort: nobody listening, a
full queue or a path too long for ``sun_path`` just drops the notice, and the sidecar reads
every layer it was not told about from its file once the engine has answered. Layer files
appear under their final name only complete (``write_atomic``), so a notice is a wake-up,
never a promise the sidecar must trust.

Deliberate limits: one KV-cache group (plain decoder attention, no MLA, no hybrid models);
the key is restricted to ``[A-Za-z0-9._-]`` so that it can never escape the staging root.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

LAYOUT_NAME = "HNC"
#: The key inside ``kv_transfer_params`` that carries an inline request's parameters:
#: ``{"disagg_inline": {"action": "save" | "load", "key": K}}`` (the connector reads it, the
#: sidecar's inline agent writes it).
INLINE_PARAMS_KEY = "disagg_inline"
#: Its actions: the prefill engine saves the request's KV, the decode engine loads it.
ACTION_SAVE = "save"
ACTION_LOAD = "load"
META_FILE = "meta.json"
ENGINE_FILE = "engine.json"
ITEMSIZE: Mapping[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "uint8": 1}
NOTICE_SUFFIX = ".notify"
#: Optional metadata key: engine pages per data block on the wire (absent: 1).
PAGES_PER_BLOCK_KEY = "pages_per_block"
#: Longest datagram a valid notice can be (a 128-character key, a space, a layer number).
NOTICE_MAX_BYTES = 160
_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class LayoutError(ValueError):
    """A layout or metadata document is malformed."""


def check_key(key: str) -> str:
    """Return ``key`` if it is a safe directory name, else raise ``LayoutError``."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key) or key in (".", ".."):
        raise LayoutError(f"bad inline KV key {key!r}")
    return key


def layer_file(layer_idx: int) -> str:
    return f"layer-{layer_idx:04d}.kv"


def fingerprint(essentials: Mapping[str, Any]) -> str:
    """A stable hash of the model/config facts that decide whether KV is reusable."""
    canon = json.dumps(dict(essentials), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canon.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class InlineLayout:
    """What one engine's KV cache looks like on the wire."""

    dtype: str
    block_size: int
    num_kv_heads: int
    head_size: int
    num_layers: int
    fingerprint: str
    layout: str = LAYOUT_NAME

    @property
    def tile_bytes(self) -> int:
        return self.num_kv_heads * self.block_size * self.head_size * ITEMSIZE[self.dtype]

    @property
    def block_bytes(self) -> int:
        return 2 * self.tile_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> InlineLayout:
        try:
            out = cls(
                dtype=str(doc["dtype"]),
                block_size=_pos_int(doc["block_size"]),
                num_kv_heads=_pos_int(doc["num_kv_heads"]),
                head_size=_pos_int(doc["head_size"]),
                num_layers=_pos_int(doc["num_layers"]),
                fingerprint=str(doc["fingerprint"]),
                layout=str(doc.get("layout", LAYOUT_NAME)),
            )
        except (KeyError, TypeError) as exc:
            raise LayoutError(f"bad inline KV layout: {exc}") from exc
        if out.dtype not in ITEMSIZE:
            raise LayoutError(f"unknown KV dtype {out.dtype!r}")
        if out.layout != LAYOUT_NAME:
            raise LayoutError(f"unknown KV layout {out.layout!r}")
        return out


@dataclass(frozen=True)
class InlineMeta:
    """One request's KV: its layout, how many tokens and engine pages it covers, its key.

    ``num_blocks`` counts engine pages (vLLM blocks of ``block_size`` tokens) per layer, as in
    the layer files. ``pages_per_block`` is the wire's granularity only: each data block of
    the gRPC stream carries that many consecutive pages of one layer (the last run of a layer
    may carry fewer). It is 1 in every file the connector reads or writes, and the document
    names it only when it is not 1, so page-sized streams are byte for byte what they were
    before the key existed.
    """

    layout: InlineLayout
    num_tokens: int
    num_blocks: int
    key: str
    version: int = 1
    pages_per_block: int = 1

    @property
    def runs_per_layer(self) -> int:
        """Data blocks per layer on the wire: ``ceil(num_blocks / pages_per_block)``."""
        return -(-self.num_blocks // self.pages_per_block)

    def run_pages(self, run_idx: int) -> range:
        """The engine pages that data block ``run_idx`` of a layer carries."""
        first = run_idx * self.pages_per_block
        return range(first, min(first + self.pages_per_block, self.num_blocks))

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "version": self.version,
            "kind": "inline_kv",
            "key": self.key,
            "num_tokens": self.num_tokens,
            "num_blocks": self.num_blocks,
            **self.layout.to_dict(),
        }
        if self.pages_per_block != 1:
            doc[PAGES_PER_BLOCK_KEY] = self.pages_per_block
        return doc

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True).encode()

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> InlineMeta:
        if not isinstance(doc, Mapping):
            raise LayoutError("inline KV metadata is not an object")
        if doc.get("version") != 1 or doc.get("kind") != "inline_kv":
            raise LayoutError("inline KV metadata: wrong version or kind")
        layout = InlineLayout.from_dict(doc)
        try:
            num_tokens = _pos_int(doc["num_tokens"])
            num_blocks = _pos_int(doc["num_blocks"])
            key = check_key(str(doc["key"]))
            # Absent in documents of senders that predate runs: one page per block.
            pages_per_block = _pos_int(doc.get(PAGES_PER_BLOCK_KEY, 1))
        except (KeyError, TypeError) as exc:
            raise LayoutError(f"bad inline KV metadata: {exc}") from exc
        if num_blocks != -(-num_tokens // layout.block_size):
            raise LayoutError(
                f"inline KV metadata: {num_blocks} blocks do not cover {num_tokens} tokens "
                f"at block size {layout.block_size}"
            )
        return cls(layout=layout, num_tokens=num_tokens, num_blocks=num_blocks, key=key,
                   pages_per_block=pages_per_block)

    @classmethod
    def from_json(cls, data: bytes) -> InlineMeta:
        try:
            doc = json.loads(data)
        except ValueError as exc:
            raise LayoutError(f"inline KV metadata is not JSON: {exc}") from exc
        return cls.from_dict(doc)


def _pos_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LayoutError(f"expected a positive integer, got {value!r}")
    return value


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees either nothing or all of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as fh:
        fh.write(data)
    tmp.replace(path)


def read_engine_layout(root: Path) -> InlineLayout | None:
    """The layout the local engine's connector published, or None if none yet."""
    try:
        data = (root / ENGINE_FILE).read_bytes()
    except FileNotFoundError:
        return None
    try:
        return InlineLayout.from_dict(json.loads(data))
    except ValueError as exc:
        raise LayoutError(f"bad {ENGINE_FILE}: {exc}") from exc


def notice_path(root: Path, key: str) -> Path:
    """Where the sidecar waiting for ``key`` listens for layer notices."""
    return root / f".{check_key(key)}{NOTICE_SUFFIX}"


def encode_notice(key: str, layer_idx: int) -> bytes:
    return f"{check_key(key)} {int(layer_idx)}".encode("ascii")


def parse_notice(data: bytes) -> tuple[str, int] | None:
    """``(key, layer)`` of a notice datagram, or None for anything else (ignored, not fatal)."""
    if len(data) > NOTICE_MAX_BYTES:
        return None
    try:
        key, layer = data.decode("ascii").split(" ")
        index = int(layer)
        check_key(key)
    except (UnicodeDecodeError, ValueError):  # LayoutError is a ValueError
        return None
    if index < 0 or not layer.isdigit():
        return None
    return key, index


def notice_sender() -> socket.socket:
    """An unbound, non-blocking datagram socket for ``send_notice`` (one per process is enough)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    # Never block the engine's forward pass on a slow or stuck sidecar: drop the notice instead.
    sock.setblocking(False)
    return sock


def send_notice(sock: socket.socket, root: Path, key: str, layer_idx: int) -> bool:
    """Tell the sidecar waiting for ``key`` that ``layer_idx``'s file is complete.

    Best effort: False when nobody listens (no socket, a stale one), the sidecar's queue is
    full, or the path does not fit ``sun_path``; the sidecar then reads the file at the end.
    """
    try:
        sock.sendto(encode_notice(key, layer_idx), str(notice_path(root, key)))
    except OSError:
        return False
    return True
