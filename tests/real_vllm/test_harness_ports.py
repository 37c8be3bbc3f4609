"""The harness's free ports stay free for the engine they are meant for.

Proves: a port ``free_port()`` returned is held (a socket binding it without
``SO_REUSEADDR`` fails, as ``bind`` to port 0 and a ``connect``'s ephemeral port skip it)
until it is released, while the ways the engines bind their ports still work on it: vLLM's
API server socket (``SO_REUSEADDR``, then listen), a ZeroMQ listener (the NIXL side channel,
the KV-events endpoint) and asyncio's ``create_server`` (uvicorn: Mooncake's bootstrap
server); a run of ports for a data-parallel engine is held whole; a group releases the ports
its engines took when it closes.

No engine is started: the engines' binds are reproduced with the same calls.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from real_vllm.harness import EngineEnv, EngineGroup, free_port, free_port_run, release_port


@pytest.fixture
def port() -> Iterator[int]:
    reserved = free_port()
    yield reserved
    release_port(reserved)


def plain_bind(port: int) -> None:
    """Bind ``port`` the way an unrelated process's socket would (no ``SO_REUSEADDR``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_a_reserved_port_is_not_free_for_anyone_else(port: int) -> None:
    with pytest.raises(OSError):
        plain_bind(port)


def test_two_reservations_never_share_a_port() -> None:
    ports = [free_port() for _ in range(50)]
    try:
        assert len(set(ports)) == len(ports)
    finally:
        for reserved in ports:
            release_port(reserved)


def test_a_released_port_is_free_again(port: int) -> None:
    release_port(port)
    plain_bind(port)


def test_vllm_api_server_binds_and_listens_on_a_reserved_port(port: int) -> None:
    # vllm/entrypoints/launchers/launcher.py create_server_socket: SO_REUSEADDR, bind, listen.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            accepted, _ = server.accept()
            accepted.close()


def test_a_zmq_listener_binds_a_reserved_port(port: int) -> None:
    context = zmq.Context()
    try:
        router = context.socket(zmq.ROUTER)
        router.bind(f"tcp://127.0.0.1:{port}")
        router.close(linger=0)
    finally:
        context.term()


def test_asyncio_create_server_binds_a_reserved_port(port: int) -> None:
    async def serve() -> None:
        server = await asyncio.start_server(lambda r, w: None, "0.0.0.0", port)
        server.close()
        await server.wait_closed()

    asyncio.run(serve())


def test_a_run_of_ports_is_held_whole() -> None:
    base = free_port_run(3)
    try:
        for offset in range(3):
            with pytest.raises(OSError):
                plain_bind(base + offset)
    finally:
        for offset in range(3):
            release_port(base + offset)


def test_a_group_releases_the_ports_of_its_engines_when_it_closes(tmp_path: Path) -> None:
    env = EngineEnv(root=tmp_path, python=tmp_path / "python", model_dir=tmp_path / "model")
    with EngineGroup(env, root=tmp_path / "group") as group:
        taken = free_port()
        group.ports.add(taken)  # what spawn() records for the ports an engine takes
        with pytest.raises(OSError):
            plain_bind(taken)
    plain_bind(taken)
