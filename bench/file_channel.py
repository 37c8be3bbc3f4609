"""What a KV data channel beside the gRPC stream could reach: layer files moved file to file.

    python -m bench.file_channel [--layers 32 --layer-mib 1 --repeat 5]

Not a transport: the shape of one, with nothing else on it, to size the design in
bench/RESULTS.md ("A data channel beside the stream"). ``--layers`` files of ``--layer-mib``
on /dev/shm (a prefill engine's layer files) go over one loopback TCP connection into new
files on /dev/shm (a decode sidecar's staging files), a sender thread to a receiver here:

    sender:    ``sendfile`` (no copy into user space), or ``read`` and ``sendall``
    receiver:  ``mapped``: sizes each new file, maps it and ``recv_into``s the mapping (the
               kernel's copy from the socket into the file's pages the only one), or
               ``write``: ``recv_into`` a buffer, then ``write`` it to the new file

Reported: best MB/s of each of the four ways over ``--repeat`` runs, counted once per KV
byte (one hop: the router is out of the data path), the same KV's time as
``bench.kv_throughput`` counts it
(``as_two_hops_mb_s``: twice the bytes over the time, comparable with its
``grpc_path_mb_s``), and raw loopback TCP of twice the bytes (``bench.kv_throughput``'s
reference). Deliberate limits: plaintext, one connection, no protocol (sizes known to both
ends), sender and receiver threads of one process.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bench.kv_throughput import make_root, raw_loopback_mb_s

_CHUNK = 1 << 20
#: Each way: (the sender sendfiles, the receiver writes into mapped files).
_MODES = {
    "sendfile_mapped": (True, True),
    "sendfile_write": (True, False),
    "read_mapped": (False, True),
    "read_write": (False, False),
}


def _send_files(sock: socket.socket, paths: list[Path], zero_copy: bool) -> None:
    """``zero_copy``: ``sendfile``; else read and ``sendall``."""
    for path in paths:
        with path.open("rb", buffering=0) as fh:
            size = os.fstat(fh.fileno()).st_size
            if zero_copy:
                sent = 0
                while sent < size:
                    sent += os.sendfile(sock.fileno(), fh.fileno(), sent, size - sent)
            else:
                sock.sendall(fh.read())


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got : got + _CHUNK])
        if n == 0:
            raise EOFError("the sender closed early")
        got += n


def _recv_files(sock: socket.socket, directory: Path, count: int, size: int,
                mapped_files: bool) -> None:
    """``mapped_files``: ``recv_into`` each new file's mapping; else a buffer, then ``write``."""
    buffer = bytearray(size)
    for i in range(count):
        fd = os.open(directory / f"layer-{i:04d}.kv", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if mapped_files:
                os.ftruncate(fd, size)
                with mmap.mmap(fd, size) as mapped, memoryview(mapped) as view:
                    _recv_exactly(sock, view)
            else:
                with memoryview(buffer) as view:
                    _recv_exactly(sock, view)
                    os.write(fd, view)
        finally:
            os.close(fd)


def _one_run(paths: list[Path], target: Path, size: int, mode: tuple[bool, bool]) -> float:
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)

        def sender() -> None:
            conn, _ = server.accept()
            with conn:
                _send_files(conn, paths, mode[0])

        thread = threading.Thread(target=sender)
        thread.start()
        started = time.perf_counter()
        with socket.create_connection(server.getsockname()) as client:
            _recv_files(client, target, len(paths), size, mode[1])
        elapsed = time.perf_counter() - started
        thread.join()
    return elapsed


def _best(run: Callable[[], float], repeat: int) -> float:
    run()  # warm-up
    return min(run() for _ in range(repeat))


def _runner(paths: list[Path], target: Path, size: int,
            mode: tuple[bool, bool]) -> Callable[[], float]:
    return lambda: _one_run(paths, target, size, mode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--layer-mib", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    size = args.layer_mib << 20
    total = args.layers * size
    root = make_root()
    try:
        source = root / "prefill"
        source.mkdir()
        paths = []
        for i in range(args.layers):
            path = source / f"layer-{i:04d}.kv"
            path.write_bytes(os.urandom(size))
            paths.append(path)
        results: dict[str, float] = {"kv_bytes": total}
        for name, mode in _MODES.items():
            seconds = _best(_runner(paths, root / "decode", size, mode), args.repeat)
            results[f"{name}_ms"] = round(seconds * 1e3, 2)
            results[f"{name}_mb_s"] = round(total / seconds / 1e6, 1)
            results[f"{name}_as_two_hops_mb_s"] = round(2 * total / seconds / 1e6, 1)
        results["raw_loopback_two_hops_mb_s"] = round(raw_loopback_mb_s(2 * total), 1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
