"""Fault switches and observability of the stub engines.

Proves: each fault kind does what the sidecar must survive (status with an engine-like body,
delay, hang, truncated and malformed bodies and streams, dropped and stalled streams, wrong
content type, oversized bodies, a prefill without its hand-off); ``times`` limits a fault to
the next K requests; path-specific faults; faults set at construction, through the Python
object and over HTTP (/_stub/faults, served only when asked for: 404 by default); a client
that goes away cancels the stub's handler, which ``wait_idle`` and the cancelled count show.
Timing faults are checked by state, not by the clock.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from stub_builders import NIXL_PREFILL_PARAMS, completion, sse_events

from sidecar.tools.stubs import Fault, FaultKind, Stub, StubConfig, run_stub

STREAM = completion(max_tokens=4, stream=True)


async def raw(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, str, bytes]:
    async with session.post(url, json=body) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), await resp.read()


async def test_status_fault_for_next_k_requests(session: aiohttp.ClientSession) -> None:
    async with run_stub(engine="vllm") as s:
        s.faults.add("status", status=503, message="overloaded", times=2)
        for _ in range(2):
            status, _, data = await raw(session, s.url + "/v1/completions", completion())
            assert status == 503
            assert json.loads(data) == {
                "error": {
                    "message": "overloaded",
                    "type": "ServiceUnavailableError",
                    "param": None,
                    "code": 503,
                }
            }
        status, _, _ = await raw(session, s.url + "/v1/completions", completion())
        assert status == 200
        assert s.faults.active() == [] and s.faults.fired == 2


async def test_fault_from_config_and_path_filter(session: aiohttp.ClientSession) -> None:
    config = StubConfig(
        engine="sglang",
        faults=(
            Fault(FaultKind.STATUS, path="/health", status=503),
            Fault(FaultKind.STATUS, status=500, times=1),
        ),
    )
    async with run_stub(config) as s:
        async with session.get(s.url + "/health") as resp:
            assert resp.status == 503
        async with session.get(s.url + "/metrics") as resp:
            assert resp.status == 200  # a path-less fault never touches /metrics
        status, _, data = await raw(session, s.url + "/generate", {"text": "x"})
        assert status == 500 and json.loads(data) == {"error": {"message": "stub fault"}}


async def test_faults_endpoint_only_when_asked_for(session: aiohttp.ClientSession) -> None:
    async with (
        run_stub(engine="vllm") as default,
        run_stub(engine="vllm", control_faults=True) as on,
    ):
        for method in ("GET", "POST", "DELETE"):
            async with session.request(
                method, default.url + "/_stub/faults", json={"kind": "hang"}
            ) as resp:
                assert resp.status == 404
            async with session.request(
                method, on.url + "/_stub/faults", json={"kind": "drop"}
            ) as resp:
                assert resp.status == 200
        assert default.faults.active() == [] and default.faults.fired == 0
        status, _, _ = await raw(session, default.url + "/v1/completions", completion())
        assert status == 200


async def test_http_control_endpoint(session: aiohttp.ClientSession) -> None:
    async with run_stub(engine="trtllm", control_faults=True) as s:
        async with session.post(
            s.url + "/_stub/faults", json={"kind": "status", "status": 429, "times": 1}
        ) as resp:
            assert resp.status == 200
            assert (await resp.json())[0]["status"] == 429
        async with session.post(s.url + "/_stub/faults", json={"kind": "nope"}) as resp:
            assert resp.status == 400
        async with session.post(
            s.url + "/_stub/faults", json={"kind": "hang", "colour": 1}
        ) as resp:
            assert resp.status == 400
        status, _, data = await raw(session, s.url + "/v1/completions", completion())
        assert status == 429 and json.loads(data)["object"] == "error"
        async with session.post(
            s.url + "/_stub/faults", json=[{"kind": "status"}, {"kind": "hang"}]
        ) as resp:
            assert len(await resp.json()) == 2
        async with session.delete(s.url + "/_stub/faults") as resp:
            assert await resp.json() == []
        status, _, _ = await raw(session, s.url + "/v1/completions", completion())
        assert status == 200
        async with session.get(
            s.url + "/_stub/requests", params={"path": "/v1/completions"}
        ) as resp:
            recorded = await resp.json()
        assert len(recorded) == 2 and recorded[0]["json"]["prompt"] == "Hello, stub world"
        async with session.get(s.url + "/_stub/stats") as resp:
            stats = await resp.json()
        assert stats["total"] == 2 and stats["faults_fired"] == 1
        async with session.get(s.url + "/_stub/info") as resp:
            assert (await resp.json())["port"] == s.port


async def test_delay_then_normal_answer(session: aiohttp.ClientSession) -> None:
    async with run_stub(engine="vllm") as s:
        s.faults.add("delay", delay_s=0.01, times=1)
        status, _, data = await raw(session, s.url + "/v1/completions", completion())
        assert status == 200 and json.loads(data)["choices"]
        assert s.faults.fired == 1


async def cancel_in_flight(
    s: Stub, session: aiohttp.ClientSession, body: Any, *, headers_first: bool
) -> None:
    """Start a request, wait until the stub holds it (or sent headers), then go away."""

    async def call() -> None:
        async with session.post(s.url + "/v1/completions", json=body) as resp:
            headers.set_result(resp.status)
            await resp.read()

    headers: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(call())
    if headers_first:
        assert await headers == 200
    else:
        await s.recorder.next_request("/v1/completions")
    assert s.recorder.in_flight == 1  # the stub is still holding the request
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await s.wait_idle()
    assert s.recorder.cancelled == 1


async def test_hang_until_client_goes_away(session: aiohttp.ClientSession) -> None:
    async with run_stub(engine="vllm") as s:
        s.faults.add("hang")
        await cancel_in_flight(s, session, completion(), headers_first=False)


async def test_stall_after_headers_and_after_chunks(session: aiohttp.ClientSession) -> None:
    async with run_stub(engine="vllm") as s:
        s.faults.add("stall", times=1)
        await cancel_in_flight(s, session, completion(), headers_first=True)
    async with run_stub(engine="vllm") as s:
        s.faults.add("stall", after_chunks=2)
        async with session.post(s.url + "/v1/completions", json=STREAM) as resp:
            first = await resp.content.readuntil(b"\n\n")
            second = await resp.content.readuntil(b"\n\n")
            assert first.startswith(b"data: {") and second.startswith(b"data: {")
            assert s.recorder.in_flight == 1
        await s.wait_idle()
        assert s.recorder.cancelled == 1


async def test_truncated_bodies(session: aiohttp.ClientSession) -> None:
    async with run_stub(engine="vllm") as s:
        s.faults.add("truncate", times=1)
        status, ctype, data = await raw(session, s.url + "/v1/completions", completion())
        assert status == 200 and ctype.startswith("application/json")
        with pytest.raises(json.JSONDecodeError):
            json.loads(data)
        assert data.startswith(b'{"id":"cmpl-')
        s.faults.add("truncate", after_chunks=2, times=1)
        status, _, data = await raw(session, s.url + "/v1/completions", STREAM)
        text = data.decode()
        assert "[DONE]" not in text
        blocks = text.split("\n\n")
        assert len(blocks) == 3 and blocks[2].startswith("data: {")
        with pytest.raises(json.JSONDecodeError):
            json.loads(blocks[2][len("data: ") :])


async def test_malformed_bodies(session: aiohttp.ClientSession) -> None:
    async with run_stub(engine="vllm") as s:
        s.faults.add("malformed", times=1)
        status, _, data = await raw(session, s.url + "/v1/completions", completion())
        assert status == 200
        with pytest.raises(json.JSONDecodeError):
            json.loads(data)
        s.faults.add("malformed", after_chunks=1, times=1)
        _, _, data = await raw(session, s.url + "/v1/completions", STREAM)
        blocks = [b for b in data.decode().split("\n\n") if b]
        json.loads(blocks[0][6:])
        with pytest.raises(json.JSONDecodeError):
            json.loads(blocks[1][6:])
        assert blocks[-1] == "data: [DONE]"


async def test_dropped_connection(session: aiohttp.ClientSession) -> None:
    async with run_stub(engine="vllm") as s:
        s.faults.add("drop", times=1)
        with pytest.raises(aiohttp.ClientError):
            await raw(session, s.url + "/v1/completions", completion())
        s.faults.add("drop", after_chunks=2, times=1)
        got: list[bytes] = []
        with pytest.raises(aiohttp.ClientError):
            async with session.post(s.url + "/v1/completions", json=STREAM) as resp:
                async for line in resp.content:
                    got.append(line)
        assert [g for g in got if g.startswith(b"data: ")][:2] and len(
            [g for g in got if g.startswith(b"data: ")]
        ) == 2
        await s.wait_idle()
        status, _, _ = await raw(session, s.url + "/v1/completions", completion())
        assert status == 200


async def test_wrong_content_type_and_oversized(session: aiohttp.ClientSession) -> None:
    async with run_stub(engine="vllm") as s:
        s.faults.add("content_type", times=2)
        _, ctype, data = await raw(session, s.url + "/v1/completions", completion())
        assert ctype.startswith("text/html") and json.loads(data)["choices"]
        _, ctype, data = await raw(session, s.url + "/v1/completions", STREAM)
        assert ctype.startswith("text/html") and sse_events(data.decode())[-1] == "[DONE]"
        s.faults.add("oversized", size=2_000_000, times=1)
        _, _, data = await raw(session, s.url + "/v1/completions", completion())
        assert len(data) > 2_000_000 and json.loads(data)["choices"]
        s.faults.add("oversized", size=100_000, after_chunks=1, times=1)
        _, _, data = await raw(session, s.url + "/v1/completions", STREAM)
        assert max(len(b) for b in data.split(b"\n\n")) > 100_000


async def test_no_handoff_on_vllm_prefill(session: aiohttp.ClientSession) -> None:
    async with run_stub(engine="vllm", role="prefill") as s:
        s.faults.add("no_handoff", times=1)
        body = completion(max_tokens=1, kv_transfer_params=NIXL_PREFILL_PARAMS)
        _, _, data = await raw(session, s.url + "/v1/completions", body)
        assert json.loads(data)["kv_transfer_params"] is None
        _, _, data = await raw(session, s.url + "/v1/completions", body)
        assert json.loads(data)["kv_transfer_params"]["do_remote_prefill"] is True


async def test_client_gone_mid_stream_cancels_handler(session: aiohttp.ClientSession) -> None:
    async with run_stub(engine="vllm", itl_s=3600.0) as s:  # the stub would wait an hour per token
        async with session.post(s.url + "/v1/completions", json=STREAM) as resp:
            await resp.content.readuntil(b"\n\n")
            assert s.recorder.in_flight == 1
        await s.wait_idle()
        assert s.recorder.cancelled == 1
        assert s.engine.running == 0  # type: ignore[attr-defined]
        assert s.open_connections == 0  # the client closed its connection, not pooled it


async def test_recorder_limit_keeps_cursor_positions() -> None:
    from sidecar.tools.stubs import Recorder

    rec = Recorder(limit=4)
    for i in range(3):
        rec.decide("/p", f"r{i}", "local", "x")
    assert (await rec.next_decision()).request_id == "r0"
    for i in range(3, 9):
        rec.decide("/p", f"r{i}", "local", "x")
    # r1.. were dropped by the limit; the cursor moves to the oldest kept one.
    got = [(await rec.next_decision()).request_id for _ in range(len(rec.decisions))]
    assert got == [d.request_id for d in rec.decisions]
    assert got[-1] == "r8"
