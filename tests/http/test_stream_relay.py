"""Proves the streamed relay's bytes on the wire, with a decode engine pacing its tokens (each
its own read, so the relay's per-read path writes them): an HTTP/1.1 client gets a chunked
body whose chunks carry the engine's SSE events in order, ending with ``[DONE]`` and the
closing chunk; an HTTP/1.0 client gets the same events unframed, the body ending with the
connection, as aiohttp frames it. Over real sockets, the vLLM NIXL flow.
"""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest
from pd_builders import pd_pair, sse_events, streamed_text

from sidecar.tools.stubs.faults import Fault, FaultKind
from sidecar.tools.stubs.textgen import is_remote_text

TOKENS = 5


def raw_request(version: bytes, target: str) -> bytes:
    body = orjson.dumps({"model": "stub-model", "prompt": "Hello there", "max_tokens": TOKENS,
                         "stream": True})
    return (b"POST /v1/completions HTTP/" + version + b"\r\nHost: sidecar\r\n"
            b"Content-Type: application/json\r\nConnection: close\r\n"
            b"x-prefiller-host-port: " + target.encode() + b"\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body)


async def exchange(port: int, data: bytes) -> tuple[bytes, bytes]:
    """Send ``data``, read until the sidecar closes; the head and the raw body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        raw = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return head, body


def dechunk(body: bytes) -> list[bytes]:
    chunks: list[bytes] = []
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert body == b"\r\n"  # the closing chunk, nothing after it
            return chunks
        chunks.append(body[:size])
        assert body[size:size + 2] == b"\r\n"
        body = body[size + 2:]


@pytest.mark.parametrize("version", [b"1.1", b"1.0"])
async def test_paced_tokens_reach_the_client_framed_as_aiohttp_frames_them(
    version: bytes,
) -> None:
    async with pd_pair("vllm", "shfs", decode_overrides={"itl_s": 0.005}) as pair:
        head, body = await exchange(pair.sidecar.ports["http"], raw_request(version, pair.target))
    assert head.startswith(b"HTTP/" + version + b" 200 OK\r\n")  # aiohttp answers in kind
    chunked = b"transfer-encoding: chunked" in head.lower()
    if version == b"1.1":
        assert chunked
        text = b"".join(dechunk(body)).decode()
    else:
        assert not chunked and b"content-length" not in head.lower()
        assert body.startswith(b"data: ")  # no chunk-size line in front of the events
        text = body.decode()
    assert text.endswith("data: [DONE]\n\n")
    events = sse_events(text)
    assert len(events) == TOKENS + 1
    assert is_remote_text(streamed_text(text))  # the decode used the prefill's KV


async def read_until_done(port: int, data: bytes) -> bytes:
    """Send ``data``, read until the stream's ``[DONE]`` event, then hang up at once (as many
    SSE clients do); what was read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.readuntil(b"data: [DONE]\n\n"), 30)
    finally:
        writer.close()
        await writer.wait_closed()


async def test_a_stream_delivered_whole_is_counted_by_what_it_was_when_the_client_hangs_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The decode engine writes every event, [DONE] too, and holds its end: the client hangs
    # up while the sidecar still waits for the exchange to end. The answer was delivered
    # whole: counted ok (not cancelled), and nothing is logged above debug.
    linger = {"faults": [Fault(FaultKind.LINGER, path="/v1/completions")]}
    async with pd_pair("vllm", "shfs", decode_overrides=linger) as pair:
        caplog.set_level(logging.INFO)
        read = await read_until_done(pair.sidecar.ports["http"],
                                     raw_request(b"1.1", pair.target))
        assert b" 200 " in read.split(b"\r\n", 1)[0]

        async def counted() -> bool:
            return await pair.sidecar.metric("disagg_requests_total", front_door="http") == 1

        async with asyncio.timeout(10):
            while not await counted():  # noqa: ASYNC110 (the counter is read by scraping)
                await asyncio.sleep(0.01)
        assert await pair.sidecar.metric("disagg_requests_total", outcome="ok") == 1
        assert await pair.sidecar.metric("disagg_requests_total", outcome="cancelled") == 0
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_a_client_gone_after_the_last_event_is_no_error_at_the_end() -> None:
    # The response's end written to a transport the client already closed (aiohttp raises
    # ClientConnectionResetError there): the relay's finish says so at debug, nothing else.
    from aiohttp import ClientConnectionResetError

    from sidecar.http_server.relay import SSERelay

    class Closing:
        async def write_eof(self) -> None:
            raise ClientConnectionResetError("Cannot write to closing transport")

    relay = SSERelay.__new__(SSERelay)
    relay.response = Closing()  # type: ignore[assignment]
    await relay.finish()  # raises nothing
