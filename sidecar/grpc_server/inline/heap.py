"""Keep freed heap memory for reuse: inline KV messages are tens of MiB, allocated per request.

    retain_freed_heap(retain_bytes)   (glibc only; a no-op returning False elsewhere)
      mallopt(M_MMAP_MAX, 0)              large blocks come from the heap, not from fresh mmaps
      mallopt(M_TRIM_THRESHOLD, retain)   up to ``retain`` free bytes stay mapped after a free
      mallopt(M_ARENA_MAX, 1)             threads that allocate from now on share one heap

Why: glibc serves every allocation over its mmap threshold (128 KiB, adapting up to 32 MiB)
with a fresh ``mmap`` and returns it with ``munmap`` on free. A gRPC message of a request's
KV (grpc-core's receive buffer, the Python ``bytes`` handed to the servicer, the files' tiles)
is then faulted in page by page on every request: measured on this project's 2-core machine,
a 32 MiB unary request into a grpc.aio server moved ~400 MB/s that way and ~1,250-1,450 MB/s
with the memory reused (``python -m bench.grpc_ceiling``), and the inline decode leg of
``bench.kv_throughput`` went from ~0.21 s to ~0.08 s per 32 MiB.

Cost, deliberately accepted: the process keeps up to ``retain_bytes`` of freed memory mapped
(its resident size stays near its high-water mark, which the staging and message limits
already bound) instead of handing it back between requests. One arena: grpc-core's threads
and the event loop's would otherwise each keep their own retained heap, and the decode
sidecar's peak crept up request after request (32 MiB KV: 194 MB after 2 requests, 275 MB
after 101; with one arena 183-184 MB after 11 and after 101, at the same speed).

Deliberate limits: process-wide and one-way (called at gRPC server start in inline mode,
before the server's threads exist; threads that allocated earlier keep their arenas);
other allocators (musl, jemalloc via LD_PRELOAD) are left alone; ``MALLOC_MMAP_MAX_`` /
``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_ARENA_MAX`` in the environment do the same for a
process started with them (from its first allocation on).
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
