"""One in-flight counter per worker in a shared memory-mapped file: ``--max-inflight`` as a
bound on the whole pool, not on each worker.

    InflightSlots.create(path, count)          the supervisor: a zeroed file, count x int64
    InflightSlots.open(path, count, index)     a worker: its own slot, every slot readable
    slots.others()  the sum of the other workers' slots;   slots.publish(n)  this worker's

Deliberate limits: no lock, so workers admitting at the same instant can pass the bound by at
most ``count - 1`` requests. Why slots and not one counter:
docs/extending/design-notes.md#pool-slots
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

_SLOT = struct.Struct("=q")


class InflightSlots:
    """This worker's view of the pool's in-flight counters."""

    def __init__(self, memory: mmap.mmap, count: int, index: int) -> None:
        self._memory = memory
        self._count = count
        self._index = index
        self._all = struct.Struct(f"={count}q")
        self._own_offset = index * _SLOT.size

    @staticmethod
    def create(path: Path, count: int) -> None:
        """Make (or reset) the file: ``count`` zeroed slots."""
        path.write_bytes(bytes(count * _SLOT.size))

    @classmethod
    def open(cls, path: Path, count: int, index: int) -> InflightSlots:
        if not 0 <= index < count:
            raise ValueError(f"slot {index} is outside 0..{count - 1}")
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size != count * _SLOT.size:
                raise ValueError(f"{path} holds {size} bytes, not {count} slots")
            memory = mmap.mmap(fd, size)  # MAP_SHARED: every worker sees each write
        finally:
            os.close(fd)
        slots = cls(memory, count, index)
        slots.publish(0)  # a restarted worker starts from nothing in flight
        return slots

    @staticmethod
    def clear(path: Path, index: int) -> None:
        """Zero a (dead) worker's slot: its requests ended with its process."""
        with path.open("r+b") as file:
            file.seek(index * _SLOT.size)
            file.write(_SLOT.pack(0))

    def total(self) -> int:
        """Requests in flight in the whole pool, this worker's own included."""
        return sum(self._all.unpack_from(self._memory))

    def others(self) -> int:
        """Requests in flight in the other workers."""
        own: int = _SLOT.unpack_from(self._memory, self._own_offset)[0]
        return self.total() - own

    def publish(self, inflight: int) -> None:
        _SLOT.pack_into(self._memory, self._own_offset, inflight)

    def close(self) -> None:
        self._memory.close()
