"""The floor of relaying tokens in Python: a bare uvloop TCP forwarder, for the paced bench.

    python -m bench.bare_relay --upstream 127.0.0.1:8200 [--port 0]
    -> {"port": N} on stdout once listening

Each accepted connection gets its own connection to ``--upstream``; bytes are forwarded
both ways as they arrive (``data_received`` -> ``transport.write``, one read and one write per
arrival, no parsing, no task), with the peers' flow control passed through (a full write
buffer on one side pauses reading on the other). The paced mode sends the decode leg through
it: its CPU per token is what the kernel and the event loop alone cost for one read and one
write per token on this machine, the floor under anything that relays HTTP in Python.

Deliberate limits: plain TCP, loopback; no HTTP awareness (so no keep-alive of its own: the
client's connection and its upstream one live and die together).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from typing import cast


class _Side(asyncio.Protocol):
    """One end of a forwarded pair; writes what it reads into its peer."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.pending: list[bytes] = []  # bytes read before the peer connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=256 * 1024)

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is None or peer.transport is None:
            self.pending.append(data)
            return
        peer.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()

    def attach(self, peer: _Side) -> None:
        """Pair with ``peer`` (connected now) and flush what arrived before it."""
        self.peer = peer
        if self.pending and peer.transport is not None:
            peer.transport.write(b"".join(self.pending))
        self.pending = []


class _Downstream(_Side):
    """An accepted client connection: opens its upstream one and pairs with it."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__()
        self.host = host
        self.port = port
        self.connecting: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        loop = asyncio.get_running_loop()
        self.connecting = loop.create_task(self._connect(loop))

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            _, upstream = await loop.create_connection(_Side, self.host, self.port)
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        if self.transport is None or self.transport.is_closing():
            if upstream.transport is not None:
                upstream.transport.close()
            return
        upstream.peer = self
        self.attach(upstream)


async def serve(upstream: str, host: str, port: int) -> None:
    up_host, _, up_port = upstream.rpartition(":")
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _Downstream(up_host, int(up_port)), host, port, backlog=4096
    )
    print(json.dumps({"port": server.sockets[0].getsockname()[1]}), flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bare_relay",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--upstream", required=True, help="HOST:PORT to forward to")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    factory = None
    with contextlib.suppress(ImportError):
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(serve(args.upstream, args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
