"""Keep freed heap memory for reuse: inline KV messages are tens of MiB, allocated per request.

    retain_freed_heap(retain_bytes)   (glibc only; a no-op returning False elsewhere)
      mallopt(M_MMAP_MAX, 0)              large blocks come from the heap, not from fresh mmaps
      mallopt(M_TRIM_THRESHOLD, retain)   up to ``retain`` free bytes stay mapped after a free
      mallopt(M_ARENA_MAX, 1)             threads that allocate from now on share one heap

Deliberate limits: process-wide and one-way (at gRPC server start, before its threads
exist); other allocators are left alone. Why, the cost, the measurements:
docs/extending/design-notes.md#retained-heap
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Final

logger = logging.getLogger(__name__)

#: glibc's <malloc.h> parameter numbers.
M_TRIM_THRESHOLD: Final = -1
M_MMAP_MAX: Final = -4
M_ARENA_MAX: Final = -8


def retain_freed_heap(retain_bytes: int) -> bool:
    """Tune glibc's malloc as the module docstring says; True when it took effect."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it (musl has mallopt too)
    except (OSError, AttributeError):
        logger.info("not glibc: freed heap memory is not retained (large KV messages are "
                    "faulted in per request)")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt takes an int: a larger retain is capped at the largest one it can express.
    retain = max(0, min(retain_bytes, 2**31 - 1))
    ok = all(
        mallopt(param, value)
        for param, value in ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, retain), (M_ARENA_MAX, 1))
    )
    if ok:
        logger.info("malloc: no mmap for large blocks, up to %d freed bytes retained, one "
                    "arena", retain)
    return ok
