"""Request directories on the staging volume that no request owns any more: found, removed.

    sweep_orphans(root, owned, older_than_s)     one pass; returns the names removed
    OrphanSweeper(root, owned, older_than_s).run(interval_s)    a pass now, then periodically

Why: every request removes its own directory when it ends, whatever the end. One case escapes
that: a Prefill cancelled while the engine's forward pass is already saving its KV (vLLM
cannot stop a forward pass in progress) gets its layer files written *after* the sidecar
removed the directory, and a sidecar that crashed leaves its requests' files behind. On a
memory-backed volume those bytes would stay until the pod dies. The sweep removes them.

What counts as an orphan: an entry named like this project's request keys (``p-<32 hex>``
prefill, ``d-<32 hex>`` decode, or a prefill's notice socket ``.p-<32 hex>.notify``) that no
in-flight request of this process owns and that has not changed for ``older_than_s`` (an
engine's late writes come within one forward pass, so the age also guards a directory the
engine is still writing). Nothing else in the root is touched (``engine.json``, other
tenants' files).

Deliberate limits: age is the entry's own mtime (a directory's changes with every file the
connector creates, the layer files being written under a temporary name and renamed); one
sidecar process per staging root (the owned set is in memory).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Collection
from pathlib import Path

logger = logging.getLogger(__name__)

_KEY = re.compile(r"^(?:[pd]-[0-9a-f]{32}|\.p-[0-9a-f]{32}\.notify)$")


def _key_of(name: str) -> str:
    """The request key an entry belongs to (``.p-K.notify`` belongs to ``p-K``)."""
    return name[1 : -len(".notify")] if name.startswith(".") else name


def sweep_orphans(
    root: Path, owned: Collection[str], older_than_s: float, now: float | None = None
) -> list[str]:
    """Remove the orphans under ``root`` (see the module docstring); the names removed."""
    now = time.time() if now is None else now
    removed: list[str] = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if not _KEY.match(entry.name) or _key_of(entry.name) in owned:
            continue
        try:
            age = now - entry.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:
            continue  # removed meanwhile by its own request
        if age <= older_than_s:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            try:
                Path(entry.path).unlink()
            except FileNotFoundError:
                continue
        removed.append(entry.name)
    return removed


class OrphanSweeper:
    """Sweeps ``root`` now and then every ``interval_s`` (run as a task; cancel to stop)."""

    def __init__(
        self, root: Path, owned: Callable[[], Collection[str]], older_than_s: float
    ) -> None:
        self.root = root
        self._owned = owned
        self.older_than_s = older_than_s

    async def sweep(self) -> list[str]:
        # The owned set is read on the loop (it changes there); the file work in a thread.
        owned = frozenset(self._owned())
        removed = await asyncio.to_thread(sweep_orphans, self.root, owned, self.older_than_s)
        if removed:
            logger.warning("removed %d orphaned KV staging entries under %s: %s",
                           len(removed), self.root, ", ".join(sorted(removed)[:5]))
        return removed

    async def run(self, interval_s: float) -> None:
        while True:
            try:
                await self.sweep()
            except OSError as exc:  # a volume problem must not end the sweeper
                logger.warning("KV staging sweep of %s failed: %s", self.root, exc)
            await asyncio.sleep(interval_s)
