"""Proves the Responses, Messages and token-in generate routes through the HTTP front door,
per route x engine/connector as the routes table of docs/driving/routes.md says, over real sockets
and stub
engines that serve those routes as the engines do:

- PD pairs: each leg's body (the API's prefill rules, the dialect's hand-off; the decode is
  the client's body plus the hand-off, every key the client left out still out), the decode's
  verdict (it used the prefill's KV), JSON and streamed answers ending as the API ends them;
- routes an engine serves but not as a pair run whole on the local engine (``local_route``,
  logged at debug), routes it does not serve are refused (404, ``unserved_route``), Responses
  requests naming stored state run whole on the local engine (``local_state``);
- usage: what the client is told equals what one engine tells for the same prompt, cold and
  warm (vLLM-like figures: NIXL decodes report no cache writes, Mooncake decodes the whole
  prompt as cached);
- errors before the first byte in the API's shape; after it, an engine's own error event is
  relayed and counted, a cut stream ends with the API's own error event.

Does not prove the real engines' behaviour (tests/real_vllm does, for vLLM).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp
import pytest
from pd_builders import metric_reaches, pd_pair
from protocol_builders import nixl_prefill_skeleton
from route_builders import (
    LOCAL_CASES,
    ROUTE_CASES,
    UNSERVED_CASES,
    answer_text,
    answer_usage,
    case_id,
    named_events,
    route_body,
)

from sidecar.protocol.context import Route
from sidecar.tools.stubs import Fault, FaultKind, StubConfig, run_stub
from sidecar.tools.stubs.textgen import is_local_text, is_remote_text

#: The hand-off keys each dialect adds to both legs (SGLang's per-route request id aside).
HANDOFF_KEYS = {"vllm": {"kv_transfer_params"},
                "sglang": {"bootstrap_host", "bootstrap_port", "bootstrap_room", "rid",
                           "request_id"}}
LAST_EVENT = {Route.RESPONSES: "response.completed", Route.MESSAGES: "message_stop",
              Route.GENERATE: None}


def _api_prefill(route: Route, client: dict[str, Any]) -> dict[str, Any]:
    """The client's body after the route's API's prefill rules."""
    body = dict(client)
    body["stream"] = False
    body.pop("stream_options", None)
    if route is Route.RESPONSES:
        body.update(max_output_tokens=1, store=False)
        body.pop("background", None)
    elif route is Route.MESSAGES:
        body["max_tokens"] = 1
    else:
        body["sampling_params"] = {**client["sampling_params"], "max_tokens": 1}
    return body


def _check_handoff(route: Route, engine: str, connector: str, prefill: dict[str, Any],
                   decode: dict[str, Any], pair: Any) -> None:
    if engine == "vllm" and connector == "shfs":
        assert prefill["kv_transfer_params"] == nixl_prefill_skeleton()
        params = decode["kv_transfer_params"]
        assert params["do_remote_prefill"] is True
        assert params["remote_host"] == "127.0.0.1"  # rewritten from the engine's "localhost"
        assert params["remote_port"] == pair.prefill.port
    elif engine == "vllm":
        transfer = prefill["kv_transfer_params"]["transfer_id"]
        assert decode["kv_transfer_params"] == {
            "do_remote_decode": False, "do_remote_prefill": True, "transfer_id": transfer,
            "remote_bootstrap_addr": f"http://127.0.0.1:{pair.prefill.bootstrap_port}",
            "remote_engine_id": pair.prefill.engine_id,
        }
    else:
        for key in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):
            assert decode[key] == prefill[key]
        room = prefill["bootstrap_room"]
        if route is Route.RESPONSES:
            # SGLang's Responses rid is its request_id (the response's id: resp_ prefix).
            assert prefill["request_id"] == decode["request_id"] == f"resp_req-r.1-{room}"
            assert "rid" not in prefill
        else:
            assert "rid" not in prefill and "request_id" not in prefill


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("case", ROUTE_CASES, ids=case_id)
async def test_route_runs_as_a_pair(case: tuple[Route, str, str], stream: bool) -> None:
    route, engine, connector = case
    async with pd_pair(engine, connector) as pair:
        client = route_body(route, stream=stream)
        status, headers, text = await pair.send(route, body=client,
                                                headers={"X-Request-Id": "req-r.1"})
        assert status == 200, text
        assert headers["X-Request-Id"] == "req-r.1"
        prefill = (await pair.prefill.recorder.next_request(route.value)).json
        decode = (await pair.decode.recorder.next_request(route.value)).json
        keys = HANDOFF_KEYS[engine]
        assert {k: v for k, v in prefill.items() if k not in keys} == _api_prefill(route, client)
        # The decode leg is the client's own body plus the hand-off: nothing else added.
        assert {k: v for k, v in decode.items() if k not in keys} == client
        _check_handoff(route, engine, connector, prefill, decode, pair)

        decision = await pair.decode.recorder.next_decision()
        assert (decision.outcome, decision.reason) == ("remote", "ok")
        answer = answer_text(route, text, stream)
        assert answer and is_remote_text(answer)
        if stream:
            assert headers["Content-Type"].startswith("text/event-stream")
            last = named_events(text)[-1]
            assert last[0] == LAST_EVENT[route] if LAST_EVENT[route] else last[1] == "[DONE]"
        await metric_reaches(pair.sidecar, "disagg_requests_total", 1, route=route.value,
                             outcome="ok")


@pytest.mark.parametrize("case", LOCAL_CASES, ids=case_id)
async def test_a_route_the_engine_does_not_pair_runs_whole_on_the_local_engine(
    case: tuple[Route, str, str], caplog: pytest.LogCaptureFixture,
) -> None:
    route, engine, connector = case
    caplog.set_level(logging.DEBUG, logger="sidecar.request.placement")  # the decision's log
    async with pd_pair(engine, connector) as pair:
        client = route_body(route, stream=True)
        status, _, text = await pair.send(route, body=client)
        assert status == 200, text
        seen = await pair.decode.recorder.next_request(route.value)
        assert seen.json == client  # the client's body, untouched
        assert not [r for r in pair.prefill.recorder.requests if r.path == route.value]
        assert is_local_text(answer_text(route, text, stream=True))
        await metric_reaches(pair.sidecar, "disagg_requests_total", 1, route=route.value,
                             outcome="local_route")
    assert any("does not run" in r.getMessage() and r.levelno == logging.DEBUG
               for r in caplog.records)


@pytest.mark.parametrize("case", UNSERVED_CASES, ids=case_id)
async def test_a_route_the_engine_does_not_serve_is_refused(
    case: tuple[Route, str, str],
) -> None:
    route, engine, connector = case
    async with pd_pair(engine, connector) as pair:
        status, _, text = await pair.send(route, body=route_body(route))
        assert status == 404, text
        error = json.loads(text)["error"]
        assert (error["code"], error["type"]) == ("route_not_served", "request_error")
        assert engine in error["message"] and route.value in error["message"]
        for stub in (pair.prefill, pair.decode):
            assert not [r for r in stub.recorder.requests if r.path == route.value]
        await metric_reaches(pair.sidecar, "disagg_requests_total", 1, route=route.value,
                             outcome="unserved_route")
        assert await pair.sidecar.metric("disagg_errors_total", code="route_not_served") == 1


@pytest.mark.parametrize(("engine", "field", "value", "status"), [
    ("vllm", "previous_response_id", "resp_earlier", 404),
    ("vllm", "background", True, 400),
    ("vllm", "conversation", "conv_1", 200),
    ("sglang", "previous_response_id", "resp_earlier", 400),
], ids=["vllm-previous", "vllm-background", "vllm-conversation", "sglang-previous"])
async def test_responses_state_runs_whole_on_the_local_engine(
    engine: str, field: str, value: Any, status: int,
) -> None:
    async with pd_pair(engine, "shfs") as pair:
        client = route_body(Route.RESPONSES, **{field: value})
        got, _, text = await pair.send(Route.RESPONSES, body=client)
        # The engine that holds (or lacks) the state answers, in its own words.
        assert got == status, text
        seen = await pair.decode.recorder.next_request(Route.RESPONSES.value)
        assert seen.json == client
        assert not [r for r in pair.prefill.recorder.requests
                    if r.path == Route.RESPONSES.value]
        await metric_reaches(pair.sidecar, "disagg_requests_total", 1,
                             route=Route.RESPONSES.value, outcome="local_state")


# -- usage --------------------------------------------------------------------------------

USAGE_ROUTES = [Route.COMPLETIONS, Route.CHAT, Route.RESPONSES, Route.MESSAGES,
                Route.GENERATE]


def _usage_body(route: Route, stream: bool) -> dict[str, Any]:
    prompt = "A prompt long enough for several KV blocks of sixteen tokens each. " * 2
    if route in (Route.COMPLETIONS, Route.CHAT):
        body: dict[str, Any] = {"model": "stub-model", "max_tokens": 4, "stream": stream}
        if route is Route.COMPLETIONS:
            body["prompt"] = prompt
        else:
            body["messages"] = [{"role": "user", "content": prompt}]
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body
    return route_body(route, stream=stream, max_tokens=4, prompt=prompt)


async def _read_cut(pair: Any, route: Route, body: dict[str, Any]) -> str:
    """A stream the sidecar ends on purpose unterminated: what arrived before the cut."""
    received = b""
    async with aiohttp.ClientSession() as session:
        async with session.post(pair.sidecar.url + route.value, json=body,
                                headers={"x-prefiller-host-port": pair.target}) as response:
            assert response.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):  # unterminated on purpose
                async for chunk in response.content.iter_any():
                    received += chunk
    return received.decode()


async def _post(url: str, body: dict[str, Any]) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=body) as response:
            assert response.status == 200
            return await response.text()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("connector", ["shfs", "mooncake"])
@pytest.mark.parametrize("route", USAGE_ROUTES,
                         ids=["completions", "chat", "responses", "messages", "generate"])
async def test_usage_tells_the_prompt_cache_as_one_engine_would(
    route: Route, connector: str, stream: bool,
) -> None:
    details = {"prompt_tokens_details": True}
    async with (
        pd_pair("vllm", connector, prefill_overrides=details, decode_overrides=details) as pair,
        run_stub(StubConfig(engine="vllm", role="both", kv_connector=connector,
                            **details)) as baseline,
    ):
        body = _usage_body(route, stream)
        told = []
        for _ in ("cold", "warm"):  # the second time the prefill engine hits its own cache
            status, _, text = await pair.send(route, body=body)
            assert status == 200, text
            expected = answer_usage(route, await _post(baseline.url + route.value, body), stream)
            got = answer_usage(route, text, stream)
            assert got == expected
            told.append(got)
        assert told[0] != told[1]  # the figures moved: cold and warm differ


# -- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(("route", "body", "shape"), [
    (Route.MESSAGES, {"model": "m", "messages": [{"role": "user", "content": "x"}]},
     "anthropic"),
    (Route.RESPONSES, {"model": "m", "input": "x", "max_output_tokens": "x"}, "openai"),
    (Route.GENERATE, {"model": "m", "token_ids": []}, "openai"),
    (Route.GENERATE, {"model": "m", "token_ids": [5, 6], "sampling_params": {"n": 2}},
     "openai"),
], ids=["messages-no-max-tokens", "responses-bad-limit", "generate-no-ids", "generate-n"])
async def test_bad_bodies_are_refused_in_the_apis_shape(
    route: Route, body: dict[str, Any], shape: str,
) -> None:
    async with pd_pair("vllm", "shfs") as pair:
        status, _, text = await pair.send(route, body=body)
        assert status == 400, text
        answer = json.loads(text)
        if shape == "anthropic":
            assert answer["type"] == "error"
            assert answer["error"]["type"] == "invalid_request_error"
            assert answer["error"]["code"] == "invalid_request"
        else:
            assert answer["error"]["code"] == "invalid_request"
        for stub in (pair.prefill, pair.decode):
            assert not [r for r in stub.recorder.requests if r.path == route.value]


@pytest.mark.parametrize("route", [Route.RESPONSES, Route.MESSAGES, Route.GENERATE],
                         ids=lambda r: r.value.rsplit("/", 1)[-1])
async def test_a_decode_that_fails_before_its_head_is_the_apis_error(route: Route) -> None:
    fault = Fault(FaultKind.STATUS, path=route.value, status=500)
    async with pd_pair("vllm", "shfs", decode_overrides={"faults": (fault,)}) as pair:
        status, _, text = await pair.send(route, body=route_body(route, stream=True))
        assert status == 502, text
        answer = json.loads(text)
        if route is Route.MESSAGES:
            assert answer["type"] == "error"
            assert (answer["error"]["type"], answer["error"]["code"]) == ("api_error",
                                                                          "decode_failed")
        else:
            assert (answer["error"]["type"], answer["error"]["code"]) == ("decode_error",
                                                                          "decode_failed")


async def test_generate_on_an_engine_without_scale_out_fails_at_the_prefill() -> None:
    off = {"scale_out": False}
    async with pd_pair("vllm", "shfs", prefill_overrides=off, decode_overrides=off) as pair:
        status, _, text = await pair.send(Route.GENERATE, body=route_body(Route.GENERATE))
        assert status == 502, text
        assert json.loads(text)["error"]["code"] == "prefill_failed"


@pytest.mark.parametrize(("route", "engine", "last"), [
    (Route.MESSAGES, "vllm", "error"),
    (Route.GENERATE, "vllm", "[DONE]"),
    (Route.RESPONSES, "sglang", "response.failed"),
    (Route.MESSAGES, "sglang", "message_stop"),
], ids=["messages-vllm", "generate-vllm", "responses-sglang", "messages-sglang"])
async def test_an_engines_error_event_is_relayed_as_written_and_counted(
    route: Route, engine: str, last: str,
) -> None:
    fault = Fault(FaultKind.ERROR_EVENT, path=route.value, after_chunks=2)
    async with pd_pair(engine, "shfs", decode_overrides={"faults": (fault,)}) as pair:
        status, _, text = await pair.send(route, body=route_body(route, stream=True))
        assert status == 200
        events = named_events(text)
        assert len(events) == 3 + (last == "[DONE]" or last == "message_stop")
        final = events[-1]
        assert (final[0] if route is not Route.GENERATE else final[1]) == last
        # Nothing of the sidecar's own is appended: the engine's error is the stream's end.
        assert "decode_failed" not in text
        await metric_reaches(pair.sidecar, "disagg_requests_total", 1, route=route.value,
                             outcome="error")
        assert await pair.sidecar.metric("disagg_errors_total", code="decode_failed") == 1


@pytest.mark.parametrize(("route", "kind"), [
    (Route.RESPONSES, FaultKind.ERROR_EVENT),  # vLLM 0.32 cuts its Responses stream
    (Route.MESSAGES, FaultKind.DROP),
    (Route.GENERATE, FaultKind.DROP),
], ids=["responses-cut", "messages-drop", "generate-drop"])
async def test_a_stream_cut_after_its_head_ends_with_the_apis_error_event(
    route: Route, kind: FaultKind,
) -> None:
    fault = Fault(kind, path=route.value, after_chunks=3)
    async with pd_pair("vllm", "shfs", decode_overrides={"faults": (fault,)}) as pair:
        text = await _read_cut(pair, route, route_body(route, stream=True))
        events = named_events(text)
        assert len(events) == 4  # three of the engine's, then the sidecar's error event
        name, data = events[-1]
        error = json.loads(data)
        if route is Route.RESPONSES:
            # The Responses API's own error event, numbered after the last one relayed.
            assert name == "error"
            assert error == {"type": "error", "code": "decode_failed", "param": None,
                             "message": error["message"], "sequence_number": 3}
        elif route is Route.MESSAGES:
            assert name == "error"
            assert error["type"] == "error"
            assert (error["error"]["type"], error["error"]["code"]) == ("api_error",
                                                                        "decode_failed")
        else:
            assert name is None and error["error"]["code"] == "decode_failed"
        assert "[DONE]" not in text and "message_stop" not in text
        assert "response.completed" not in text
        await metric_reaches(pair.sidecar, "disagg_requests_total", 1, route=route.value,
                             outcome="broken_stream")
