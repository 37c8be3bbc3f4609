"""Proves the HTTP front door's failure handling over real sockets: every failure of a leg gets
its status and error code (OpenAI-shaped JSON naming the stage), the error metric counts it,
no upstream request is left running, and the sidecar serves the next request.

Covers the HTTP issue's failure list; the broader fault-injection suite is tests/faults/.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
import pytest
from pd_builders import PDPair, client_body, pd_pair, sse_events

from sidecar.observability.logs import LogEvery
from sidecar.protocol.context import Route


def _inference_requests(stub: Any) -> int:
    """Requests the stub got on the OpenAI routes (the sidecar's health checks not counted)."""
    return sum(1 for r in stub.recorder.requests if r.path in {route.value for route in Route})


async def _assert_error(pair: PDPair, status: int, code: str, stage: str, **send: Any) -> None:
    got, headers, text = await pair.send(**send)
    assert got == status, text
    error = json.loads(text)["error"]
    assert error["code"] == code
    assert error["type"] == f"{stage}_error"
    assert headers.get("X-Request-Id")
    assert await pair.sidecar.metric("disagg_errors_total", stage=stage, code=code) == 1


async def _assert_still_serves(pair: PDPair) -> None:
    await pair.prefill.wait_idle()
    await pair.decode.wait_idle()
    assert await pair.sidecar.metric("disagg_inflight_requests", front_door="http") == 0
    status, _, text = await pair.send()
    assert status == 200, text


@pytest.mark.parametrize(
    ("fault", "status", "code", "stage"),
    [
        ({"kind": "status", "status": 500}, 502, "prefill_failed", "prefill"),
        ({"kind": "status", "status": 503}, 502, "prefill_failed", "prefill"),
        ({"kind": "status", "status": 400}, 400, "engine_rejected_request", "prefill"),
        ({"kind": "status", "status": 404}, 502, "prefill_failed", "prefill"),
        ({"kind": "malformed"}, 502, "prefill_failed", "prefill"),
        ({"kind": "truncate"}, 502, "prefill_failed", "prefill"),
        ({"kind": "no_handoff"}, 502, "invalid_handoff", "handoff"),
        ({"kind": "delay", "delay_s": 30.0}, 504, "deadline_exceeded", "prefill"),
        ({"kind": "hang"}, 504, "deadline_exceeded", "prefill"),
    ],
    ids=["500", "503", "400", "404", "garbage", "truncated", "no-handoff", "slow", "hang"],
)
async def test_prefill_failures(fault: dict[str, Any], status: int, code: str, stage: str) -> None:
    async with pd_pair("vllm", "shfs", prefill_timeout_s=0.5) as pair:
        pair.prefill.faults.add(path="/v1/completions", times=1, **fault)
        await _assert_error(pair, status, code, stage)
        assert _inference_requests(pair.decode) == 0  # no decode without a valid hand-off
        await _assert_still_serves(pair)


async def test_prefill_unreachable_is_502() -> None:
    async with pd_pair("vllm", "shfs") as pair:
        with_dead_target = {"x-prefiller-host-port": "127.0.0.1:1"}
        settings_allow = pair.sidecar.settings.prefill_allowlist
        assert settings_allow  # the dead port is refused first unless allowed
    async with pd_pair("vllm", "shfs", prefill_allowlist=("127.0.0.1:*",)) as pair:
        status, _, text = await pair.send(headers=with_dead_target)
        assert status == 502, text
        assert json.loads(text)["error"]["code"] == "prefill_failed"
        await _assert_still_serves(pair)


@pytest.mark.parametrize(
    ("fault", "status", "code"),
    [
        ({"kind": "status", "status": 500}, 502, "decode_failed"),
        ({"kind": "status", "status": 400}, 400, "engine_rejected_request"),
    ],
    ids=["500", "400"],
)
async def test_decode_failures_before_the_first_byte(
    fault: dict[str, Any], status: int, code: str
) -> None:
    async with pd_pair("vllm", "shfs") as pair:
        pair.decode.faults.add(path="/v1/completions", times=1, **fault)
        await _assert_error(pair, status, code, "decode")
        await _assert_still_serves(pair)


async def test_decode_stream_dropped_mid_way_ends_the_stream_without_done() -> None:
    async with pd_pair("vllm", "shfs") as pair:
        pair.decode.faults.add("drop", path="/v1/completions", times=1, after_chunks=2)
        body = client_body(Route.COMPLETIONS, stream=True)
        async with aiohttp.ClientSession() as session:
            async with session.post(
                pair.sidecar.url + "/v1/completions",
                json=body,
                headers={"x-prefiller-host-port": pair.target},
            ) as response:
                assert response.status == 200
                received = bytearray()
                with pytest.raises(aiohttp.ClientPayloadError):
                    async for chunk in response.content.iter_any():
                        received += chunk
        events = sse_events(received.decode())
        assert "[DONE]" not in events
        assert json.loads(events[-1])["error"]["code"] == "decode_failed"
        assert await pair.sidecar.metric("disagg_errors_total", code="decode_failed") == 1
        await _assert_still_serves(pair)


async def test_target_not_on_the_allowlist_is_403_and_receives_nothing() -> None:
    async with pd_pair("vllm", "shfs", prefill_allowlist=("127.0.0.1:1",)) as pair:
        await _assert_error(pair, 403, "prefill_target_not_allowed", "request")
        assert _inference_requests(pair.prefill) == 0
        assert _inference_requests(pair.decode) == 0


async def test_malformed_target_header_is_400() -> None:
    async with pd_pair("vllm", "shfs") as pair:
        for bad in ("http://127.0.0.1:80", "user@127.0.0.1:80", "127.0.0.1:80/x", "::1:80"):
            status, _, text = await pair.send(headers={"x-prefiller-host-port": bad})
            assert status == 400, (bad, text)
        assert _inference_requests(pair.prefill) == 0


async def test_body_over_the_cap_is_413() -> None:
    async with pd_pair("vllm", "shfs", max_body_bytes=4096) as pair:
        body = client_body(Route.COMPLETIONS, stream=False, prompt="x" * 8192)
        await _assert_error(pair, 413, "body_too_large", "request", body=body)
        assert _inference_requests(pair.prefill) == 0


async def test_client_hand_off_fields_are_refused() -> None:
    async with pd_pair("vllm", "shfs") as pair:
        body = client_body(Route.COMPLETIONS, stream=False, kv_transfer_params={"x": 1})
        await _assert_error(pair, 400, "invalid_request", "request", body=body)


async def test_local_prefill_fallback_is_a_named_counted_policy() -> None:
    async with pd_pair("vllm", "shfs", on_prefill_failure="local") as pair:
        pair.prefill.faults.add("status", path="/v1/completions", times=1, status=500)
        status, _, text = await pair.send()
        assert status == 200, text
        decision = await pair.decode.recorder.next_decision()
        assert decision.outcome == "local"
        assert await pair.sidecar.metric(
            "disagg_prefill_fallbacks_total", reason="prefill_failed") == 1


def _nested(depth: int) -> bytes:
    """A completions body whose ``extra`` field nests arrays so the body is ``depth`` deep."""
    inner = b"[" * (depth - 1) + b"]" * (depth - 1)
    return b'{"model": "stub-model", "prompt": "hi", "max_tokens": 2, "extra": ' + inner + b"}"


@pytest.mark.parametrize("depth", [255, 600, 1024])
async def test_a_body_nested_deeper_than_the_sidecar_can_forward_is_a_typed_400(
    depth: int,
) -> None:
    # orjson parses 1,024 levels but writes only 254: such a body used to end in aiohttp's
    # plain-text 500 after the parse, counted in no error series.
    async with pd_pair("vllm") as pair:
        async with aiohttp.ClientSession() as session:
            async with session.post(pair.sidecar.url + "/v1/completions", data=_nested(depth),
                                    headers={"x-prefiller-host-port": pair.target,
                                             "Content-Type": "application/json"}) as response:
                status, text = response.status, await response.text()
        error = json.loads(text)["error"]
        assert status == 400 and error["code"] == "invalid_request", text
        assert "nest" in error["message"], error
        assert await pair.sidecar.metric("disagg_errors_total", code="invalid_request") == 1
        assert _inference_requests(pair.prefill) == 0


async def test_a_body_254_levels_deep_still_runs() -> None:
    async with pd_pair("vllm") as pair:
        async with aiohttp.ClientSession() as session:
            async with session.post(pair.sidecar.url + "/v1/completions", data=_nested(254),
                                    headers={"x-prefiller-host-port": pair.target,
                                             "Content-Type": "application/json"}) as response:
                assert response.status == 200, await response.text()


REASON = "This model's maximum context length is 4096 tokens. However, you requested 5016"


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm"])
@pytest.mark.parametrize(("leg", "status"), [("prefill", 400), ("prefill", 422),
                                             ("decode", 400), ("decode", 422)])
async def test_an_engines_4xx_reason_reaches_the_client_naming_the_leg(
    engine: str, leg: str, status: int
) -> None:
    async with pd_pair(engine) as pair:
        stub = pair.prefill if leg == "prefill" else pair.decode
        stub.faults.add("status", path="/v1/completions", times=1, status=status,
                        message=REASON)
        got, _, text = await pair.send()
    error = json.loads(text)["error"]
    assert got == 400 and error["code"] == "engine_rejected_request", text
    assert REASON in error["message"], error
    named = f"prefill target {pair.target}" if leg == "prefill" else "decode engine"
    assert error["message"].startswith(f"{named} rejected the request (HTTP {status}): "), error


async def test_a_relayed_reason_is_cut_to_4_kib_without_control_characters() -> None:
    async with pd_pair("vllm") as pair:
        reason = "bad\x1b[31m\x00 input\r\n" + "é" * 5000
        pair.prefill.faults.add("status", path="/v1/completions", times=1, status=400,
                                message=reason)
        _, _, text = await pair.send()
    message = json.loads(text)["error"]["message"]
    relayed = message.split("): ", 1)[1]
    assert relayed.startswith("bad[31m input é"), relayed
    assert len(relayed.encode()) <= 4096 and relayed.endswith("é")
    assert not any(ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0 for ch in message), message


async def test_a_5xx_body_is_never_relayed() -> None:
    async with pd_pair("vllm") as pair:
        pair.prefill.faults.add("status", path="/v1/completions", times=1, status=500,
                                message="secret prompt text")
        got, _, text = await pair.send()
    assert got == 502 and "secret prompt text" not in text, text


async def test_local_prefill_fallbacks_are_logged_at_a_bounded_rate(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    async with pd_pair("vllm", "shfs", on_prefill_failure="local") as pair:
        pair.prefill.faults.add("status", path="/v1/completions", times=5, status=500)
        for _ in range(5):
            status, _, text = await pair.send()
            assert status == 200, text
        assert await pair.sidecar.metric("disagg_prefill_fallbacks_total") == 5
    lines = [r.getMessage() for r in caplog.records if "on-prefill-failure local" in
             r.getMessage()]
    assert len(lines) == 1, lines  # five fallbacks within the bound: one line
    assert "prefill_failed" in lines[0] and "local engine" in lines[0], lines


def test_the_rate_bound_says_how_many_lines_it_left_out() -> None:
    clock = [100.0]
    every = LogEvery(10.0, clock=lambda: clock[0])
    assert every.due() == 0  # the first is logged
    assert [every.due() for _ in range(3)] == [None, None, None]
    clock[0] += 10.0
    assert every.due() == 3  # the next line says three were left out
    assert every.due() is None


async def _cancel_after(pair: PDPair, stub_path_seen: Any, stream: bool) -> None:
    """Send a request, wait until ``stub_path_seen`` fires, then drop the client."""
    body = client_body(Route.COMPLETIONS, stream=stream, max_tokens=64)

    async def send() -> None:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                pair.sidecar.url + "/v1/completions",
                json=body,
                headers={"x-prefiller-host-port": pair.target},
            ) as response:
                async for _ in response.content.iter_any():
                    pass

    task = asyncio.ensure_future(send())
    await stub_path_seen
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_client_disconnect_during_prefill_ends_the_prefill_request() -> None:
    async with pd_pair("vllm", "shfs") as pair:
        pair.prefill.faults.add("hang", path="/v1/completions", times=1)
        await _cancel_after(pair, pair.prefill.recorder.next_request("/v1/completions"), False)
        await pair.prefill.wait_idle()
        assert pair.prefill.recorder.cancelled == 1
        assert _inference_requests(pair.decode) == 0
        await _assert_still_serves(pair)


async def test_client_disconnect_during_decode_ends_the_decode_request() -> None:
    async with pd_pair("vllm", "shfs") as pair:
        pair.decode.faults.add("stall", path="/v1/completions", times=1, after_chunks=1)
        await _cancel_after(pair, pair.decode.recorder.next_request("/v1/completions"), True)
        await pair.decode.wait_idle()
        assert pair.decode.recorder.cancelled == 1
        await _assert_still_serves(pair)


#: Far above what the tests allow a request: a sidecar that waited for it would fail them.
_ENGINE_TIMEOUTS = {"bootstrap_timeout_s": 300.0, "waiting_timeout_s": 300.0}


async def test_sglang_prefill_failure_fails_the_request_at_once() -> None:
    async with pd_pair("sglang", prefill_overrides=_ENGINE_TIMEOUTS,
                       decode_overrides=_ENGINE_TIMEOUTS) as pair:
        pair.prefill.faults.add("status", path="/v1/completions", times=1, status=500)
        async with asyncio.timeout(5):  # the engines would wait 300 s for their bootstrap
            await _assert_error(pair, 502, "prefill_failed", "prefill")
        await pair.decode.wait_idle()
        await _assert_still_serves(pair)


async def test_sglang_prefill_deadline_aborts_the_waiting_decode() -> None:
    async with pd_pair("sglang", prefill_overrides=_ENGINE_TIMEOUTS,
                       decode_overrides=_ENGINE_TIMEOUTS, prefill_timeout_s=1.0) as pair:
        pair.prefill.faults.add("hang", path="/v1/completions", times=1)
        async with asyncio.timeout(5):
            await _assert_error(pair, 504, "deadline_exceeded", "prefill")
        decode_seen = await pair.decode.recorder.next_request("/v1/completions")
        abort = await pair.decode.recorder.next_request("/abort_request")
        assert abort.json == {"rid": decode_seen.json["rid"]}
        await pair.decode.wait_idle()
        await pair.prefill.wait_idle()
        await _assert_still_serves(pair)
