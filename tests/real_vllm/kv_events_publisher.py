"""vLLM's own KV-event classes and ZMQ publisher, driven from the sidecar's venv.

A helper process in the engine venv imports ``vllm.distributed.kv_events`` (vLLM 0.32.0) and
answers one JSON command per stdin line with one ``RESULT`` line:

    ["encode", events, ts?]            -> hex of msgspec-msgpack(KVEventBatch(events, rank 0),
                                          stamped ts, else now)
    ["start", endpoint, replay, topic] -> a ZmqEventPublisher (connects to a non-wildcard TCP
                                          endpoint, binds its replay ROUTER)
    ["publish", events]                -> one batch published (queued to its thread)

``events`` are plain JSON: ``{"stored": {...}}`` (hashes as ints or ``"b:<hex>"`` bytes, the
extra keys in vLLM's tagged form, published through vLLM's ``to_event_extra_keys``),
``{"removed": {...}}``, ``{"cleared": {}}`` (``spec_kind``: the ``kv_cache_spec_kind`` the
engine's KV-cache manager adds to each BlockStored). So the events the sidecar decodes are built by
vLLM's classes and encoders: a change of vLLM's format breaks the tests that use this.

Deliberate limits: the publisher runs until the helper exits (closing stdin stops it).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from real_vllm.harness import EngineEnv

_RESULT = "RESULT "
_SCRIPT = f"""
import json, sys, time
import msgspec
from vllm.distributed.kv_events import (
    AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher)
from vllm.v1.core.kv_cache_utils import to_event_extra_keys

def block_hash(value):
    # "b:<hex>": a bytes hash (vLLM's sha256 ones); an int or None as it is.
    return bytes.fromhex(value[2:]) if isinstance(value, str) else value

def extra(keys):
    if keys is None:
        return None
    return to_event_extra_keys([None if k is None else tuple(tuple(t) for t in k) for k in keys])

def event(spec):
    (kind, fields), = spec.items()
    if kind == "stored":
        return BlockStored(
            block_hashes=[block_hash(h) for h in fields["hashes"]],
            parent_block_hash=block_hash(fields.get("parent")),
            token_ids=fields["tokens"], block_size=fields["block_size"],
            lora_id=fields.get("lora_id"), medium=fields.get("medium", "GPU"),
            lora_name=fields.get("lora_name"), extra_keys=extra(fields.get("extra")),
            group_idx=fields.get("group_idx", 0), kv_cache_spec_kind=fields.get("spec_kind"))
    if kind == "removed":
        return BlockRemoved(block_hashes=[block_hash(h) for h in fields["hashes"]],
                            medium=fields.get("medium", "GPU"), group_idx=0)
    return AllBlocksCleared()

def batch(specs, ts=None):
    return KVEventBatch(ts=time.time() if ts is None else ts, events=[event(s) for s in specs],
                        data_parallel_rank=0)

publisher = None
for line in sys.stdin:
    command, *args = json.loads(line)
    if command == "encode":
        result = msgspec.msgpack.encode(batch(*args)).hex()
    elif command == "start":
        endpoint, replay, topic = args
        publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint,
                                      replay_endpoint=replay, topic=topic)
        result = "ok"
    elif command == "publish":
        publisher.publish(batch(args[0]))
        result = "ok"
    sys.stdout.write({_RESULT!r} + json.dumps(result) + "\\n")
    sys.stdout.flush()
if publisher is not None:
    publisher.shutdown()
"""


class VllmEventPublisher:
    """The helper process (see the module doc)."""

    def __init__(self, env: EngineEnv) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="vllm-kv-events-")
        tmp = self._tmp.name
        environ = {name: tmp for name in
                   ("HOME", "TMPDIR", "XDG_CACHE_HOME", "VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT")}
        environ.update({"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                        "PATH": "/usr/bin:/bin"})
        self.tmp = Path(tmp)
        self._stderr_path = self.tmp / "stderr.log"
        with self._stderr_path.open("wb") as stderr:
            self._proc = subprocess.Popen(
                [str(env.python), "-c", _SCRIPT], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=stderr, env=environ, text=True)

    def __enter__(self) -> VllmEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, *command: Any) -> Any:
        stdin, stdout = self._proc.stdin, self._proc.stdout
        assert stdin is not None and stdout is not None
        stdin.write(json.dumps(list(command)) + "\n")
        stdin.flush()
        for line in stdout:
            if line.startswith(_RESULT):
                return json.loads(line[len(_RESULT):])
        raise RuntimeError(
            f"vLLM event helper exited ({self._proc.wait()}):\n"
            f"{self._stderr_path.read_text(errors='replace')[-3000:]}")

    def encode(self, events: list[dict[str, Any]], ts: float | None = None) -> bytes:
        return bytes.fromhex(self.call("encode", events, ts))

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()  # the helper shuts its publisher down and exits
        try:
            self._proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._tmp.cleanup()
