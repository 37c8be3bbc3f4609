"""The decode side's staging area: request directories on the shared volume, bounded.

``StagingArea.stage(kv)`` is an async context manager: it reserves the request's bytes
against ``max_bytes`` (over the bound: RESOURCE_EXHAUSTED, nothing written), writes the layer
files, then ``meta.json`` (the connector trusts a directory only once that file exists) under a
fresh key, yields the key, and removes the directory and the reservation however the block
exits. ``staged_keys()`` and ``reserved_bytes`` let tests assert that nothing leaks.

Deliberate limits: one process owns a staging root (reservations are in memory); the
engine-published ``engine.json`` in the root is never touched.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from connectors.inline_layout import META_FILE, InlineMeta, layer_file, write_atomic
from sidecar.errors import ResourceExhausted, Stage
from sidecar.grpc_server.inline.wire import InlineKV, Tile
from sidecar.tasks import wait_to_the_end

#: Buffers per ``writev`` call (the POSIX minimum of IOV_MAX; Linux allows 1024).
_IOV_MAX = 1024


class StagingArea:
    """Bounded per-request KV directories under ``root`` (see the module docstring)."""

    def __init__(self, root: Path, max_bytes: int,
                 on_change: Callable[[int], None] | None = None) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._reserved: dict[str, int] = {}
        #: Told the bytes staged whenever they change (the ``disagg_staged_kv_bytes`` gauge).
        self._on_change = on_change
        root.mkdir(parents=True, exist_ok=True)

    @property
    def reserved_bytes(self) -> int:
        return sum(self._reserved.values())

    def owned_keys(self) -> frozenset[str]:
        """Keys of the requests staging or staged now (the orphan sweep leaves them alone)."""
        return frozenset(self._reserved)

    def staged_keys(self) -> list[str]:
        """Request directories present on disk (tests: empty after every request)."""
        return sorted(p.name for p in self.root.iterdir() if p.is_dir())

    def _reserve(self, nbytes: int) -> str:
        # Checked and recorded without an await in between: no two requests race past it.
        if self.reserved_bytes + nbytes > self.max_bytes:
            raise ResourceExhausted(
                f"inline KV of {nbytes} bytes does not fit: {self.reserved_bytes} of "
                f"{self.max_bytes} staged bytes in use",
                stage=Stage.HANDOFF)
        key = f"d-{uuid.uuid4().hex}"
        self._reserved[key] = nbytes
        self._changed()
        return key

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.reserved_bytes)

    @asynccontextmanager
    async def stage(self, kv: InlineKV) -> AsyncIterator[str]:
        key = self._reserve(kv.nbytes)
        directory = self.root / key
        try:
            # A cancelled caller must not remove the directory while the thread still writes
            # into it (it would write on, after the removal): the write ends first.
            await wait_to_the_end(asyncio.ensure_future(
                asyncio.to_thread(self._write, directory, kv, key)))
            # Written: this frame no longer keeps the tiles (or the request they view) alive.
            del kv
            yield key
        finally:
            # Synchronous (tmpfs: fast) so that no cancellation can interrupt the clean-up.
            shutil.rmtree(directory, ignore_errors=True)
            self._reserved.pop(key, None)
            self._changed()

    @staticmethod
    def _write(directory: Path, kv: InlineKV, key: str) -> None:
        directory.mkdir()
        for layer_idx in range(kv.meta.layout.num_layers):
            _write_chunks(directory / layer_file(layer_idx), kv.layer_chunks(layer_idx))
        meta = InlineMeta(kv.meta.layout, kv.meta.num_tokens, kv.meta.num_blocks, key)
        write_atomic(directory / META_FILE, meta.to_json())


def _write_chunks(path: Path, chunks: list[Tile]) -> None:
    """One layer file from its tiles: gathered writes (one syscall per layer on tmpfs), no join."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        views = [memoryview(chunk) for chunk in chunks]
        while views:
            written = os.writev(fd, views[:_IOV_MAX])
            # A short write (not on tmpfs, but allowed): drop what went out, retry the rest.
            while views and written >= len(views[0]):
                written -= len(views[0])
                views.pop(0)
            if written:
                views[0] = views[0][written:]
    finally:
        os.close(fd)

