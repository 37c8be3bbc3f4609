"""Measuring-only start-up hook for the ENGINE venv: when vLLM makes and sends its KV events.

Loaded by a ``sitecustomize`` that ``install_dir`` writes into a directory the engine's
``PYTHONPATH`` names (``EngineSpec.extra_env``); does nothing unless
``DISAGG_KV_EVENT_TIMING`` names a file. Then it appends one line per fact, each with the
engine's ``time.time()`` (the clock of the batches' own stamp):

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

How: a meta-path finder patches ``vllm.v1.core.block_pool`` and ``vllm.distributed.kv_events``
right after they load (``BlockPool._emit_block_removed_events``; the PUB socket of
``ZmqEventPublisher`` wrapped after ``_socket_setup``). The engine core is a child process of
the API server: it inherits the environment and loads the hook too.

Deliberate limits: for the lag tool (bench/kv_event_lag.py) and the cache workload test only;
the wrapped send decodes each payload again (microseconds for these batches).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
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
# Loaded by its path: the suite's directory never goes on the engine's sys.path.
_SITECUSTOMIZE = """\
import importlib.util
_spec = importlib.util.spec_from_file_location("kv_event_timing_hook", {hook!r})
_spec.loader.exec_module(importlib.util.module_from_spec(_spec))
"""


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


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, log: _Log) -> None:
        self._inner = inner
        self._log = log

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        if module.__name__ == _BLOCK_POOL:
            _patch_block_pool(module, self._log)
        else:
            _patch_kv_events(module, self._log)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, log: _Log) -> None:
        self._log = log

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in (_BLOCK_POOL, _KV_EVENTS):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, self._log)
                return spec
        return None


def install_dir(directory: Path) -> Path:
    """Write a ``sitecustomize`` that loads this hook into ``directory`` (put it on the
    engine's ``PYTHONPATH``, with ``DISAGG_KV_EVENT_TIMING`` set); the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    hook = str(Path(__file__).resolve())
    (directory / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(hook=hook))
    return directory


def _install() -> None:
    path = os.environ.get(ENV_VAR, "")
    if path and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(_Log(path)))


_install()
