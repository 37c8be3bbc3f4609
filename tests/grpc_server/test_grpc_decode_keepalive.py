"""Proves that a gRPC Decode hands its engine connection back to the pool.

The engine here is a raw asyncio HTTP/1.1 server that controls its bytes: it streams the
decode's events and ``data: [DONE]`` as one chunk, then holds the chunked terminator
(``0\\r\\n\\r\\n``) until the test, as the router, has received the ``done`` TokenStream.
The terminator therefore arrives strictly after ``[DONE]``, in a later read (the case that
used to close the connection). Two Decodes in a row must then travel on one engine
connection, and the sidecar's pool must hold it idle afterwards. A second case sends bytes
that break the HTTP framing after ``[DONE]``: the client still gets every token and ``done``
with status OK, and the broken connection is not reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from grpc_server.grpc_builders import CHANNEL_OPTIONS, grpc_sidecar

from sidecar.grpc_gen import disagg_pb2, disagg_pb2_grpc
from sidecar.grpc_server.native import encode_handoff

#: A guard against a hang when the code under test is broken; never reached when it works.
GUARD_S = 30
TOKENS = [11, 12, 13]


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _json_response(doc: object) -> bytes:
    body = json.dumps(doc).encode()
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


@dataclass
class TailEngine:
    """A vLLM stand-in whose decode answer ends with a terminator sent on the test's cue."""

    tail: bytes = b"0\r\n\r\n"
    connections: int = 0
    #: The connection (its number, from 1) each decode answer went out on.
    completions: list[int] = field(default_factory=list)
    send_tail: asyncio.Event = field(default_factory=asyncio.Event)
    port: int = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                lines = head.decode("latin-1").split("\r\n")
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                await reader.readexactly(length)
                path = lines[0].split(" ")[1]
                if path == "/v1/completions":
                    self.completions.append(number)
                    await self._stream(writer)
                elif path == "/v1/models":
                    writer.write(_json_response({"object": "list", "data": [{"id": "m"}]}))
                else:
                    writer.write(_json_response({}))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _stream(self, writer: asyncio.StreamWriter) -> None:
        self.send_tail.clear()
        events = b"".join(
            b"data: %s\n\n" % json.dumps({"choices": [{
                "index": 0, "text": "x", "token_ids": [t],
                "finish_reason": "length" if i == len(TOKENS) - 1 else None,
            }]}).encode()
            for i, t in enumerate(TOKENS)
        )
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n"
                     + _chunk(events + b"data: [DONE]\n\n"))
        await writer.drain()
        async with asyncio.timeout(GUARD_S):
            await self.send_tail.wait()
        writer.write(self.tail)


@contextlib.asynccontextmanager
async def tail_engine(tail: bytes = b"0\r\n\r\n") -> AsyncIterator[TailEngine]:
    engine = TailEngine(tail)
    server = await asyncio.start_server(engine.serve, "127.0.0.1", 0)
    engine.port = server.sockets[0].getsockname()[1]
    try:
        yield engine
    finally:
        server.close()
        await server.wait_closed()


def decode_request(rid: str) -> disagg_pb2.DecodeRequest:
    handoff = encode_handoff(
        {"kv_transfer_params": {"remote_block_ids": [[1]]}},
        request_id=rid, engine="vllm", kv_connector="shfs",
        prefill_host="10.0.0.7", prefill_port=8000,
    )
    return disagg_pb2.DecodeRequest(
        request_id=rid, kv_blocks=handoff, token_ids=[1, 2, 3], max_new_tokens=3
    )


async def decode_once(address: str, engine: TailEngine, rid: str) -> list[disagg_pb2.TokenStream]:
    """Decode; let the engine send its tail once ``done`` is here; read to the RPC's end."""
    got: list[disagg_pb2.TokenStream] = []
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        call = disagg_pb2_grpc.DecodeWorkerStub(channel).Decode(
            decode_request(rid), timeout=GUARD_S
        )
        async for message in call:
            got.append(message)
            if message.done:
                engine.send_tail.set()
    return got


async def test_decode_reads_the_terminator_and_reuses_the_connection() -> None:
    async with tail_engine() as engine, grpc_sidecar(
        f"http://127.0.0.1:{engine.port}", engine="vllm", kv_connector="shfs", role="decode"
    ) as side:
        client = side.runtime.session
        for rid in ("a", "b"):
            got = await decode_once(side.address, engine, rid)
            assert [m.token_id for m in got if not m.done] == TOKENS
            assert got[-1].done and got[-1].finish_reason == "length"
        # Both decodes on one connection, and it is back in the pool, idle.
        assert len(engine.completions) == 2
        assert engine.completions[0] == engine.completions[1]
        assert client.open_connections == 1


async def test_a_broken_tail_keeps_the_answer_and_drops_the_connection() -> None:
    async with tail_engine(tail=b"zz\r\n") as engine, grpc_sidecar(
        f"http://127.0.0.1:{engine.port}", engine="vllm", kv_connector="shfs", role="decode"
    ) as side:
        for rid in ("a", "b"):
            got = await decode_once(side.address, engine, rid)
            assert [m.token_id for m in got if not m.done] == TOKENS
            assert got[-1].done
        assert len(engine.completions) == 2
        assert engine.completions[0] != engine.completions[1]  # the broken one was not reused
