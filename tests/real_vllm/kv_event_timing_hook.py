"""Measuring-only start-up hook for the ENGINE venv: when vLLM makes and sends its KV events.

Loaded by ``engine_site.py``'s ``sitecustomize`` (``engine_site.install_dir(directory,
kv_event_timing_hook)``); does nothing unless ``DISAGG_KV_EVENT_TIMING`` names a file. Then
it appends one line per fact, each with the engine's ``time.time()`` (the clock of the
batches' own stamp):

    publisher <t> <pid>             the engine core made its publisher (an engine start)
    removed <t> <hash hex> ...      the block pool emitted BlockRemoved for these blocks (the
                                    engine evicted them, during a step's scheduling)
    published <t> <stamp>           the scheduler queued a batch for the publisher thread (at
                                    the end of a step, before the step's outputs leave)
    sent <t> <seq> <stamp> <n> <t done> <removed hash hex> ...
                                    the publisher thread hands batch <seq> (stamped <stamp>
                                    when the step ended) of <n> events to its ZMQ socket at
                                    <t>; the send returned at <t done> (three frames, pyzmq
                                    letting go of the GIL for each)

With ``DISAGG_KV_EVENT_UNPIN=1`` as well (an experiment, not a setting of vLLM's): the
publisher's ZMQ I/O threads may run on every CPU instead of inheriting the engine's pinning to
one core (``VLLM_CPU_OMP_THREADS_BIND``), where they wait for the model's own work.

How: ``vllm.v1.core.block_pool`` and ``vllm.distributed.kv_events`` are patched right after
they load (``BlockPool._emit_block_removed_events``; the PUB socket of ``ZmqEventPublisher``
wrapped after ``_socket_setup``).

Deliberate limits: for the lag tool (bench/kv_event_lag.py) and the cache workload test only;
the wrapped send decodes each payload again (microseconds for these batches).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

ENV_VAR = "DISAGG_KV_EVENT_TIMING"
UNPIN_ENV_VAR = "DISAGG_KV_EVENT_UNPIN"
_BLOCK_POOL = "vllm.v1.core.block_pool"
_KV_EVENTS = "vllm.distributed.kv_events"


class _Log:
    def __init__(self, path: str) -> None:
        self._file = Path(path).open("a", buffering=1)  # noqa: SIM115 - for the process
        self._lock = threading.Lock()

    def line(self, *words: object) -> None:
        with self._lock:
            self._file.write(" ".join(str(w) for w in words) + "\n")


def _hex(block_hash: object) -> str:
    return block_hash.hex() if isinstance(block_hash, bytes) else str(block_hash)


def _patch_block_pool(module: ModuleType, log: _Log) -> None:
    pool = module.BlockPool
    original = pool._emit_block_removed_events

    def emit_removed(self: Any, block_hashes: list[Any]) -> None:
        if self.enable_kv_cache_events and block_hashes:
            hashes = [_hex(module.maybe_convert_block_hash(module.get_block_hash(h)))
                      for h in block_hashes]
            log.line("removed", f"{time.time():.6f}", *hashes)
        original(self, block_hashes)

    pool._emit_block_removed_events = emit_removed


class _TimedSocket:
    """The publisher's PUB socket, noting each batch it is handed."""

    def __init__(self, socket: Any, log: _Log) -> None:
        self._socket = socket
        self._log = log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._socket, name)

    def send_multipart(self, frames: Sequence[bytes], *args: Any, **kwargs: Any) -> Any:
        import msgspec

        # Noted after the send: the note's own write must not delay the batch.
        started = time.time()
        result = self._socket.send_multipart(frames, *args, **kwargs)
        done = time.time()
        _, sequence, payload = frames
        stamp, events = msgspec.msgpack.decode(payload)[:2]
        removed = [_hex(h) for e in events if isinstance(e, dict)
                   and e.get("type") == "BlockRemoved" for h in e.get("block_hashes", [])]
        self._log.line("sent", f"{started:.6f}", int.from_bytes(sequence, "big"),
                       f"{stamp:.6f}", len(events), f"{done:.6f}", *removed)
        return result


def _patch_kv_events(module: ModuleType, log: _Log) -> None:
    publisher = module.ZmqEventPublisher
    original_setup, original_publish = publisher._socket_setup, publisher.publish

    def socket_setup(self: Any) -> None:
        original_setup(self)
        if self._pub is not None and not isinstance(self._pub, _TimedSocket):
            log.line("publisher", f"{time.time():.6f}", os.getpid())
            self._pub = _TimedSocket(self._pub, log)
            if os.environ.get(UNPIN_ENV_VAR) == "1":
                _unpin_zmq_threads(log)

    def publish(self: Any, events: Any) -> None:
        log.line("published", f"{time.time():.6f}", f"{events.ts:.6f}")
        original_publish(self, events)

    publisher._socket_setup = socket_setup
    publisher.publish = publish


def _unpin_zmq_threads(log: _Log) -> None:
    """Let this process's ZMQ background threads run on every CPU."""
    everywhere = set(range(os.cpu_count() or 1))
    for task in Path("/proc/self/task").iterdir():
        name = (task / "comm").read_text().strip()
        if name.startswith("ZMQbg"):
            os.sched_setaffinity(int(task.name), everywhere)
            log.line("unpinned", f"{time.time():.6f}", task.name, name)


def patches() -> dict[str, Any]:
    """``engine_site``'s patches: the block pool's and the publisher's modules, where a log
    file is named."""
    path = os.environ.get(ENV_VAR, "")
    if not path:
        return {}
    log = _Log(path)
    return {_BLOCK_POOL: lambda module: _patch_block_pool(module, log),
            _KV_EVENTS: lambda module: _patch_kv_events(module, log)}
