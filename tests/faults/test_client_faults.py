"""Proves the HTTP front door survives clients that misbehave: a client that goes away at
every stage of a PD request (while sending its body, during the prefill, while the decode
head is awaited, mid-stream) on every engine pair, slow-loris clients, bodies over the cap
sent chunked, oversized headers and more requests than ``max_inflight`` allows.

Each scenario asserts what the client saw (where it stayed to see anything), that every
upstream call the request made was closed (the stub engine saw its handler cancelled), that
the in-flight gauge returned to zero and that the sidecar still serves.

Does not prove the real engines notice a closed connection as fast as the stubs do (that is
why the sidecar also sends SGLang's abort call, asserted here).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from fault_builders import (
    PAIRS,
    Rig,
    client_body,
    engine_param,
    eventually,
    faults,
    read_reply,
    rig,
)

from sidecar import jsonutil
from sidecar.dialects.sglang import ABORT_PATH
from sidecar.protocol.context import Route

COMPLETIONS = Route.COMPLETIONS.value


@contextlib.asynccontextmanager
async def raw_connection(r: Rig) -> AsyncIterator[tuple[asyncio.StreamReader,
                                                         asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", r.sidecar.ports["http"])
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def request_head(r: Rig, *, content_length: int | None, extra: str = "") -> bytes:
    length = (f"Content-Length: {content_length}\r\n" if content_length is not None
              else "Transfer-Encoding: chunked\r\n")
    return (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: sidecar\r\n"
        f"x-prefiller-host-port: {r.target}\r\nContent-Type: application/json\r\n"
        f"{length}{extra}\r\n"
    ).encode()


async def gauge_at(r: Rig, value: float) -> None:
    async def check() -> bool:
        return await r.inflight() == value

    await eventually(check)


def inference_calls(r: Rig) -> int:
    return len(r.prefill.recorder.on_path(COMPLETIONS)) + len(
        r.decode.recorder.on_path(COMPLETIONS))


async def test_client_gone_while_sending_its_body_makes_no_upstream_call() -> None:
    async with rig() as r:
        async with raw_connection(r) as (_, writer):
            writer.write(request_head(r, content_length=4096) + b'{"model": "stub')
            await writer.drain()
            await gauge_at(r, 1)  # admitted, reading the body
        await r.wait_gauge_zero()
        assert inference_calls(r) == 0
        await r.check_recovered()


async def test_slow_loris_clients_do_not_block_others() -> None:
    async with rig(max_inflight=64) as r:
        async with contextlib.AsyncExitStack() as stack:
            for _ in range(16):
                _, writer = await stack.enter_async_context(raw_connection(r))
                writer.write(request_head(r, content_length=1 << 16) + b"{")
                await writer.drain()
            await gauge_at(r, 16)
            for stream in (True, False):  # others are served while the slow ones trickle
                (await r.post(stream=stream)).expect_ok(stream=stream)
        await r.wait_gauge_zero()
        assert len(r.prefill.recorder.on_path(COMPLETIONS)) == 2
        await r.check_recovered()


async def test_slow_loris_body_gets_408_and_frees_its_slot() -> None:
    async with rig(max_inflight=1, client_body_timeout_s=0.3) as r:
        async with raw_connection(r) as (reader, writer):
            writer.write(request_head(r, content_length=4096) + b'{"model": "st')
            await writer.drain()
            status_line = await reader.readline()  # no more bytes are coming from us
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            payload = jsonutil.loads(await reader.readexactly(length))
        assert status_line.split()[1] == b"408", status_line
        assert payload["error"]["code"] == "request_timeout"
        assert inference_calls(r) == 0
        await r.check_recovered()  # the one admission slot is free again


async def test_body_over_the_cap_sent_chunked_is_refused_while_reading() -> None:
    async with rig(max_body_bytes=64 * 1024) as r:

        async def chunks() -> AsyncIterator[bytes]:
            yield b'{"model": "stub-model", "prompt": "'
            for _ in range(64):  # 256 KiB, no Content-Length: only a reading cap can stop it
                yield b"x" * 4096
            yield b'"}'

        async with aiohttp.ClientSession() as client, client.post(
            r.sidecar.url + COMPLETIONS, data=chunks(),
            headers={"x-prefiller-host-port": r.target},
        ) as response:
            reply = await read_reply(response)
        reply.expect_error(413, "body_too_large")
        assert inference_calls(r) == 0
        await r.check_recovered()


async def test_a_chunked_body_over_the_cap_that_arrived_whole_is_the_taxonomys_413() -> None:
    """A chunked body (no declared length) already received in full when its handler reads
    it: refused as ``body_too_large`` JSON, as one read while it arrives is (aiohttp's own
    read would answer its text/plain 413)."""
    async with rig(max_body_bytes=2000) as r:
        body = jsonutil.dumps({**client_body(), "prompt": "x" * 4000})
        chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        async with raw_connection(r) as (reader, writer):
            writer.write(request_head(r, content_length=None, extra="Connection: close\r\n")
                         + chunked)
            await writer.drain()
            status_line, answer = await read_answer(reader)
        assert status_line.split()[1] == b"413", status_line
        assert answer["error"]["code"] == "body_too_large", answer
        assert inference_calls(r) == 0
        await r.check_recovered()


async def test_oversized_header_is_refused_and_the_sidecar_still_serves() -> None:
    async with rig() as r:
        async with raw_connection(r) as (reader, writer):
            huge = "x-padding: " + "a" * 64 * 1024 + "\r\n"
            body = jsonutil.dumps(client_body())
            writer.write(request_head(r, content_length=len(body), extra=huge) + body)
            await writer.drain()
            status_line = await reader.readline()
        assert status_line.split()[1] == b"400", status_line  # aiohttp's parser refuses it
        assert inference_calls(r) == 0
        await r.check_recovered()


async def test_over_max_inflight_is_503_with_retry_after() -> None:
    async with rig(max_inflight=1, prefill_timeout_s=30.0) as r:
        r.prefill.faults.add("hang", times=1)
        first = asyncio.ensure_future(r.post())
        await r.prefill.recorder.next_request(COMPLETIONS)
        second = await r.post(stream=True)
        second.expect_error(503, "overloaded")
        assert second.headers.get("Retry-After") == "1"
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        await r.check_recovered()


#: Where the client goes away, and what keeps the request there until it does.
STAGES: dict[str, tuple[str, dict[str, Any], bool]] = {
    "during-prefill": ("prefill", {"kind": "hang"}, False),
    "awaiting-decode-head": ("decode", {"kind": "hang"}, True),
    "mid-stream": ("decode", {"kind": "stall", "after_chunks": 2}, True),
}


@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize(("engine", "connector"), [engine_param(e, c) for e, c in PAIRS])
async def test_client_gone_at_every_stage(engine: str, connector: str, stage: str) -> None:
    leg, fault, stream = STAGES[stage]
    async with rig(engine, connector, **{leg: {"faults": faults({**fault, "times": 1})}},
                   prefill_timeout_s=30.0, read_timeout_s=30.0) as r:
        stub = r.prefill if leg == "prefill" else r.decode
        async with aiohttp.ClientSession() as client:
            sending = asyncio.ensure_future(client.post(
                r.sidecar.url + COMPLETIONS, json=client_body(stream=stream),
                headers={"x-prefiller-host-port": r.target},
            ))
            if stage == "mid-stream":
                response = await sending
                assert response.status == 200
                await response.content.readuntil(b"\n\n")  # a first event arrived
                response.close()
            else:
                await stub.recorder.next_request(COMPLETIONS)
                sending.cancel()  # the head never came: the client gives up waiting
                with contextlib.suppress(asyncio.CancelledError):
                    await sending
        await r.wait_upstreams_closed()
        assert stub.recorder.cancelled >= 1  # the faulted leg saw its client go away
        if engine == "sglang":
            abort = await r.decode.recorder.next_request(ABORT_PATH)
            assert abort.json is not None and "rid" in abort.json
        await r.check_recovered()


# -- passthrough: the same body limits and deadline as a PD request --------------------------

def passthrough_head(r: Rig, path: str, *, content_length: int | None) -> bytes:
    length = (f"Content-Length: {content_length}\r\n" if content_length is not None
              else "Transfer-Encoding: chunked\r\n")
    return (f"POST {path} HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n"
            f"{length}\r\n").encode()


async def read_answer(reader: asyncio.StreamReader) -> tuple[bytes, dict[str, Any]]:
    status_line = await reader.readline()
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return status_line, jsonutil.loads(await reader.readexactly(length))


def passthrough_calls(r: Rig, path: str) -> int:
    return len(r.decode.recorder.on_path(path)) + len(r.prefill.recorder.on_path(path))


@pytest.mark.parametrize("path", [COMPLETIONS, "/v1/embeddings"])
async def test_passthrough_body_over_the_cap_is_413_and_reaches_no_engine(path: str) -> None:
    async with rig(max_body_bytes=2000) as r:
        async with aiohttp.ClientSession() as client, client.post(
            r.sidecar.url + path, data=b'{"prompt": "' + b"x" * 5000 + b'"}'
        ) as response:
            whole = await read_reply(response)
        whole.expect_error(413, "body_too_large")
        assert passthrough_calls(r, path) == 0

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(8):  # 32 KiB, no Content-Length: only a reading cap can stop it
                yield b"x" * 4096

        async with aiohttp.ClientSession() as client, client.post(
            r.sidecar.url + path, data=chunks()
        ) as response:
            chunked = await read_reply(response)
        chunked.expect_error(413, "body_too_large")
        assert passthrough_calls(r, path) == 0
        await r.check_recovered()


@pytest.mark.parametrize("path", [COMPLETIONS, "/v1/embeddings"])
async def test_slow_passthrough_body_gets_408_and_frees_its_slot(path: str) -> None:
    async with rig(max_inflight=1, client_body_timeout_s=0.3) as r:
        async with raw_connection(r) as (reader, writer):
            writer.write(passthrough_head(r, path, content_length=4096) + b'{"model": "st')
            await writer.drain()
            status_line, payload = await read_answer(reader)  # no more bytes are coming
        assert status_line.split()[1] == b"408", status_line
        assert payload["error"]["code"] == "request_timeout"
        assert passthrough_calls(r, path) == 0
        await r.check_recovered()  # the one admission slot is free again
