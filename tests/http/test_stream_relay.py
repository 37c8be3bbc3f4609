"""Proves the streamed relay's bytes on the wire, with a decode engine pacing its tokens (each
its own read, so the relay's per-read path writes them): an HTTP/1.1 client gets a chunked
body whose chunks carry the engine's SSE events in order, ending with ``[DONE]`` and the
closing chunk; an HTTP/1.0 client gets the same events unframed, the body ending with the
connection, as aiohttp frames it. Over real sockets, the vLLM NIXL flow.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest
from pd_builders import pd_pair, sse_events, streamed_text

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
