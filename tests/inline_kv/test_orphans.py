"""Proves the staging root's orphan sweep removes exactly what no request owns any more.

Orphans are request-key entries (``p-…``/``d-…`` directories, ``.p-….notify`` sockets) that
no in-flight request owns and that are older than the threshold; owned ones, young ones and
anything not named like a request key (``engine.json``, other files) stay. The inline gRPC
servicers' sweeper counts the Prefills in flight and the decode staging's reservations as
owned. Ages are set with ``os.utime`` and the sweep is given its ``now``: no clock involved.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path

from sidecar.config.settings import KVTransport, Settings
from sidecar.grpc_server.inline.grpc import InlinePrefill
from sidecar.grpc_server.inline.orphans import sweep_orphans
from sidecar.grpc_server.server import _services
from sidecar.runtime import open_runtime

NOW = 1_000_000.0


def _entry(root: Path, name: str, age_s: float, *, kind: str = "dir") -> Path:
    path = root / name
    if kind == "dir":
        path.mkdir()
        (path / "layer-0000.kv").write_bytes(b"kv")
    elif kind == "socket":
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(str(path))
    else:
        path.write_bytes(b"{}")
    os.utime(path, (NOW - age_s, NOW - age_s), follow_symlinks=False)
    return path


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _key(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


def test_only_old_unowned_request_entries_are_removed(tmp_path: Path) -> None:
    old_prefill, old_decode, owned, young = _key("p"), _key("d"), _key("p"), _key("p")
    socket_key = _key("p")
    _entry(tmp_path, old_prefill, 500)
    _entry(tmp_path, old_decode, 500)
    _entry(tmp_path, owned, 500)
    _entry(tmp_path, young, 10)
    _entry(tmp_path, f".{socket_key}.notify", 500, kind="socket")
    _entry(tmp_path, f".{owned}.notify", 500, kind="socket")  # its request is in flight
    _entry(tmp_path, "engine.json", 500, kind="file")
    _entry(tmp_path, "p-not-a-key", 500)
    _entry(tmp_path, "someone-else", 500)
    _entry(tmp_path, f"{old_prefill}\n", 500)  # a key's pattern matches whole names

    removed = sweep_orphans(tmp_path, {owned}, older_than_s=90, now=NOW)

    assert sorted(removed) == sorted([old_prefill, old_decode, f".{socket_key}.notify"])
    assert _names(tmp_path) == sorted(
        [owned, young, f".{owned}.notify", "engine.json", "p-not-a-key", "someone-else",
         f"{old_prefill}\n"]
    )


def test_a_missing_root_is_nothing_to_sweep(tmp_path: Path) -> None:
    assert sweep_orphans(tmp_path / "absent", set(), older_than_s=0, now=NOW) == []


async def test_the_inline_servicers_sweep_spares_requests_in_flight(tmp_path: Path) -> None:
    settings = Settings(kv_transport=KVTransport.INLINE, kv_staging_dir=str(tmp_path),
                        engine_url="http://127.0.0.1:9", prefill_timeout_s=5.0)
    async with open_runtime(settings) as runtime:
        prefill_service, _, sweeper = _services(runtime)
        prefill = prefill_service.strategy
        assert isinstance(prefill, InlinePrefill) and sweeper is not None
        assert sweeper.older_than_s > settings.prefill_timeout_s  # late writes come within it
        in_flight, orphan = _key("p"), _key("p")
        prefill.active_keys.add(in_flight)
        old = time.time() - 10 * sweeper.older_than_s
        for key in (in_flight, orphan):
            (tmp_path / key).mkdir()
            os.utime(tmp_path / key, (old, old))

        assert await sweeper.sweep() == [orphan]
        assert _names(tmp_path) == [in_flight]
