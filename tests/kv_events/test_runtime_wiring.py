"""Proves the KV-events subscriber runs in the sidecar's lifecycle (sidecar/runtime.py), through
the real server (``run_server``):

- with ``--kv-events-endpoint`` the running sidecar hears a publisher (ipc: the publisher binds)
  and its /metrics shows the index's blocks; once the server stopped, the sidecar's socket is
  gone (a second sidecar binds the same TCP endpoint);
- an endpoint another socket holds stops start-up with ``PortInUse`` naming the flag, before
  anything listens.

It does not prove the index or the sequence rules (the other modules here).
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from kv_event_builders import TOKENS, FakePublisher, chain
from sidecar_builders import running_sidecar

from sidecar.workers.ports import PortInUse

WAIT_S = 10.0


async def test_the_running_sidecar_hears_the_publisher(tmp_path: Path) -> None:
    context = zmq.asyncio.Context()
    endpoint = f"ipc://{tmp_path}/events"
    publisher = FakePublisher(context, endpoint, bind=True, topic=b"kv")
    try:
        async with running_sidecar(kv_events_endpoint=endpoint, kv_events_topic="kv") as sidecar:
            async with asyncio.timeout(WAIT_S):
                assert await publisher.subscribed() == b"\x01kv"
            await publisher.send(0, [chain(TOKENS[:16], 4)])
            sequence = 1
            async with asyncio.timeout(WAIT_S):
                # Each scrape is a round trip on the sidecar's loop, which reads the batches.
                while await sidecar.metric("disagg_kv_index_blocks") != 4:
                    await publisher.send(sequence, [])
                    sequence += 1
            assert await sidecar.metric("disagg_kv_events_total", kind="block_stored") == 1
    finally:
        publisher.close()
        context.destroy(linger=0)


async def test_the_socket_closes_with_the_server() -> None:
    with socket.socket() as probe:  # a port the OS hands out (closed at once, synchronously)
        probe.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    async with running_sidecar(kv_events_endpoint=endpoint):
        pass
    async with running_sidecar(kv_events_endpoint=endpoint):  # bound again: it was released
        pass


async def test_a_held_endpoint_stops_start_up() -> None:
    probe = zmq.Context()
    holder = probe.socket(zmq.SUB)
    holder.bind("tcp://127.0.0.1:0")
    endpoint = holder.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        with pytest.raises(PortInUse, match=r"^--kv-events-endpoint tcp://127\.0\.0\.1:\d+: "):
            async with running_sidecar(kv_events_endpoint=endpoint):
                pass
    finally:
        holder.close(linger=0)
        probe.term()
