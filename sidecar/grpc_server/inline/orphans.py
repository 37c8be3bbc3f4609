"""Request directories on the staging volume that no request owns any more: found, removed.

    sweep_orphans(root, owned, older_than_s)     one pass; returns the names removed
    OrphanSweeper(root, owned, older_than_s).run(interval_s)    a pass now, then periodically

An orphan is an entry named like a request key (``p-<32 hex>``, ``d-<32 hex>``, a prefill's
``.p-<32 hex>.notify``) that no in-flight request of this process owns and that has not changed
for ``older_than_s``; nothing else in the root is touched. Deliberate limits: age is the
entry's own mtime; one sidecar (one pool) per staging root. Why a sweep, and how a pool of
workers shares it: docs/extending/design-notes.md#orphan-sweep
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

_KEY = re.compile(r"(?:[pd]-[0-9a-f]{32}|\.p-[0-9a-f]{32}\.notify)")


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
        if not _KEY.fullmatch(entry.name) or _key_of(entry.name) in owned:
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


def touch_owned(root: Path, owned: Collection[str]) -> int:
    """Set the mtime of ``owned`` entries under ``root`` to now; how many were touched."""
    touched = 0
    for key in owned:
        for name in (key, f".{key}.notify"):
            try:
                os.utime(root / name, follow_symlinks=False)
            except FileNotFoundError:
                continue
            touched += 1
    return touched


class OrphanSweeper:
    """Sweeps ``root`` now and then every ``interval_s`` (run as a task; cancel to stop), if
    ``sweeps``; with ``touches``, keeps this process's entries fresh for another's sweeps."""

    def __init__(self, root: Path, owned: Callable[[], Collection[str]], older_than_s: float,
                 *, sweeps: bool = True, touches: bool = False) -> None:
        self.root = root
        self._owned = owned
        self.older_than_s = older_than_s
        self.sweeps = sweeps
        self.touches = touches

    async def touch(self) -> int:
        owned = frozenset(self._owned())
        return await asyncio.to_thread(touch_owned, self.root, owned) if owned else 0

    async def sweep(self) -> list[str]:
        # The owned set is read on the loop (it changes there); the file work in a thread.
        owned = frozenset(self._owned())
        removed = await asyncio.to_thread(sweep_orphans, self.root, owned, self.older_than_s)
        if removed:
            logger.warning("removed %d orphaned KV staging entries under %s: %s",
                           len(removed), self.root, ", ".join(sorted(removed)[:5]))
        return removed

    async def run(self, interval_s: float) -> None:
        if self.touches:
            # Three refreshes per age limit: an owned entry never looks old to a sweep.
            interval_s = min(interval_s, self.older_than_s / 3)
        if self.sweeps:
            logger.info("sweeping KV staging %s for orphans every %.0f s", self.root, interval_s)
        while True:
            try:
                if self.touches:
                    await self.touch()
                if self.sweeps:
                    await self.sweep()
            except OSError as exc:  # a volume problem must not end the sweeper
                logger.warning("KV staging sweep of %s failed: %s", self.root, exc)
            await asyncio.sleep(interval_s)
