"""The bench's lean HTTP/1.1 client reads answers right, whatever the server's framing.

Proves: SSE events are counted across every possible split of the stream (pure counter) and
across chunked writes that cut events, the blank line and the chunk framing apart (real
socket, 7-byte writes, each drained; the kernel may still merge them, which is why the
pure counter is checked at every split too); content-length bodies
are returned whole; a keep-alive connection is reused, one the server closes (or one idle
past ``idle_s``) is replaced; a connection lost mid-answer and an answer that never comes
raise instead of hanging. Does not prove speed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from bench.http_clients import open_clients
from bench.lean_client import Client, EventCounter, Origin
from sidecar.http1 import UpstreamBroken

STREAM = b"data: {\"a\": 1}\n\ndata: {\"b\": \"x\\n\"}\n\ndata: [DONE]\n\n"

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.mark.parametrize("cut", range(1, len(STREAM)))
def test_counter_counts_across_any_split(cut: int) -> None:
    for pieces in ([STREAM[:cut], STREAM[cut:]], [STREAM[i:i + 1] for i in range(len(STREAM))]):
        counter = EventCounter()
        for piece in pieces:
            counter.feed(piece)
        assert counter.events == 3


def test_counter_on_blank_line_runs() -> None:
    counter = EventCounter()
    for piece in (b"data: a\n", b"\n", b"\n\n", b"data: b\n", b"\ndata: c\n\n\n"):
        counter.feed(piece)
    # Pairs: a|\n, \n\n, b|\n, c\n\n; the final "\n" waits for a partner.
    assert counter.events == 4


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[Origin]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> Origin:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        servers.append(server)
        return Origin("127.0.0.1", int(server.sockets[0].getsockname()[1]))

    yield start
    for server in servers:
        server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


async def test_chunked_stream_cut_anywhere(serve: Callable[[Handler], Awaitable[Origin]]) -> None:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (STREAM[:10], STREAM[10:17],
                                                              STREAM[17:]))
    wire = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n"
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        # Pieces that cut the events, the "\n\n" and the chunk framing; written one by one.
        for start in range(0, len(wire), 7):
            writer.write(wire[start:start + 7])
            await writer.drain()
        writer.close()

    origin = await serve(handler)
    client = Client(timeout_s=10)
    answer = await client.request(origin, "POST", "/s", {"a": "b"}, b"{}", count_events=True)
    await client.close()
    assert answer.status == 200 and answer.events == 3 and answer.body == b""
    assert 0 < answer.first_byte_s <= answer.latency_s


async def test_keep_alive_reuse_and_replacement(
    serve: Callable[[Handler], Awaitable[Origin]],
) -> None:
    accepted = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        while True:
            try:
                request = await read_request(reader)
            except asyncio.IncompleteReadError:
                break
            close = b"/close" in request
            extra = b"connection: close\r\n" if close else b""
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n" + extra + b"\r\nhello")
            await writer.drain()
            if close:
                break
        writer.close()

    origin = await serve(handler)
    client = Client(timeout_s=10)
    bodies = [(await client.request(origin, "GET", path)).body
              for path in ("/a", "/b", "/close", "/c")]
    assert bodies == [b"hello"] * 4
    assert accepted == 2
    stale = Client(timeout_s=10, idle_s=0.0)  # every idle connection counts as too old
    for path in ("/a", "/b"):
        await stale.request(origin, "GET", path)
    assert accepted == 4
    await client.close()
    await stale.close()


async def test_lost_connection_and_silence_raise(
    serve: Callable[[Handler], Awaitable[Origin]],
) -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await writer.drain()
        writer.close()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()  # until the client gives up and closes
        writer.close()

    patient = Client(timeout_s=10)
    with pytest.raises(UpstreamBroken):
        await patient.request(await serve(cut), "GET", "/")
    hasty = Client(timeout_s=0.05)
    with pytest.raises(TimeoutError):
        await hasty.request(await serve(silent), "GET", "/")
    await patient.close()
    await hasty.close()


async def test_both_load_clients_agree(serve: Callable[[Handler], Awaitable[Origin]]) -> None:
    wire = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
            + b"%x\r\n%s\r\n0\r\n\r\n" % (len(STREAM), STREAM))

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await read_request(reader)
            except asyncio.IncompleteReadError:
                break
            writer.write(wire)
            await writer.drain()
        writer.close()

    origin = await serve(handler)
    for kind in ("lean", "aiohttp"):
        async with open_clients(kind, 1) as new_http:
            http = new_http()
            answer = await http.post(origin, "/v1/completions", {}, b"{}", True)
            plain = await http.post(origin, "/v1/completions", {}, b"{}", False)
        assert (answer.status, answer.events) == (200, 3), kind
        assert b"data: [DONE]" in plain.body, kind
