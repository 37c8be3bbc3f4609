"""Proves each API module's rules (sidecar/protocol/apis) on what real vLLM 0.32.0 wrote
(tests/fixtures/vllm/0.32.0/routes):

- the usage rule: over the recorded legs (NIXL cold and with the prefill's cache warm, flag
  on and off; Mooncake), the usage told equals the baseline engine's for the same prompt,
  where the decode leg's own does not (chat, Responses and Messages cache writes, Messages
  input tokens, every Mooncake figure);
- the relay's whole-event reading (``relay.WholeEvents``) of the recorded streams,
  cut at every byte: the bytes pass unchanged but the rewritten usage event, the end is
  recognised, an engine's error event is, a cut Responses stream is not an end;
- the body checks, state rule, error shapes and prompt lengths of the new routes.

Does not prove the relay on sockets (tests/http/test_pd_routes.py does).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from protocol_builders import parse_client_body

from sidecar.errors import DecodeFailed, InvalidRequest
from sidecar.http_server.relay import WholeEvents
from sidecar.protocol.apis import api_of
from sidecar.protocol.context import Route
from sidecar.protocol.prompt_length import estimate_tokens, exact_tokens

ROUTES_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "0.32.0" / "routes"
NAMES = {"completions": Route.COMPLETIONS, "chat": Route.CHAT, "responses": Route.RESPONSES,
         "messages": Route.MESSAGES, "generate": Route.GENERATE}


def _load(name: str) -> dict[str, Any]:
    recorded: dict[str, Any] = json.loads((ROUTES_DIR / f"{name}.json").read_text())
    return recorded


def _matrix_cases() -> list[tuple[str, str, str]]:
    cases = []
    for flags in ("usage_details_on", "usage_details_off"):
        for name in _load(flags)["routes"]:
            for legs in ("pd_cold", "pd_prefill_warm"):
                cases.append((flags, name, legs))
    return cases


@pytest.mark.parametrize(("flags", "name", "legs"), _matrix_cases(),
                         ids=lambda v: str(v))
def test_the_usage_told_is_the_baselines(flags: str, name: str, legs: str) -> None:
    routes = _load(flags)["routes"][name]
    pd = routes[legs]
    baseline = routes["baseline_cold" if legs == "pd_cold" else "baseline_warm"]
    told = api_of(NAMES[name]).true_usage(pd["decode_usage"], pd["prefill_usage"])
    assert told == baseline


@pytest.mark.parametrize("name", ["chat", "responses", "messages"])
def test_the_decodes_own_usage_is_not_the_baselines(name: str) -> None:
    # What the rule corrects: a cold NIXL decode reports no cache writes (and Messages
    # counts the written tokens as input).
    routes = _load("usage_details_on")["routes"][name]
    assert routes["pd_cold"]["decode_usage"] != routes["baseline_cold"]


@pytest.mark.parametrize("name", ["responses", "messages", "generate"])
def test_mooncake_usage_told_is_the_baselines(name: str) -> None:
    recorded = _load(f"{name}_mooncake")
    decode = recorded["decode_response"]["json"]["usage"]
    baseline = recorded["baseline_response"]["json"]["usage"]
    assert decode != baseline  # the decode counts the pushed prompt as cached
    told = api_of(NAMES[name]).true_usage(decode, recorded["prefill_response"]["usage"])
    assert told == baseline


def test_no_prefill_details_means_none_told() -> None:
    api = api_of(Route.CHAT)
    decode = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11,
              "prompt_tokens_details": {"cached_tokens": 9}}
    assert api.true_usage(decode, {"prompt_tokens": 9})["prompt_tokens_details"] is None
    messages = api_of(Route.MESSAGES).true_usage(
        {"input_tokens": 0, "output_tokens": 2, "cache_read_input_tokens": 9}, None)
    assert messages == {"input_tokens": 9, "output_tokens": 2}


# -- streams ------------------------------------------------------------------------------


def _feed(events: WholeEvents, body: bytes, size: int) -> bytes:
    out = b""
    for start in range(0, len(body), size):
        taken = events.take(body[start:start + size])
        assert taken is not None
        out += taken
    return out


class _Known:
    """A prefill usage known from the start (sequential legs)."""

    def __init__(self, usage: dict[str, Any]) -> None:
        self.usage = usage
        self.pending = False

    def now(self) -> dict[str, Any]:
        return self.usage

    async def wait(self) -> dict[str, Any]:
        return self.usage


STREAMS = ["responses_nixl_stream", "messages_nixl_stream", "generate_nixl_stream",
           "chat_nixl_stream", "completions_nixl_stream"]


@pytest.mark.parametrize("size", [1, 7, 64, 1 << 20], ids=lambda s: f"reads-of-{s}")
@pytest.mark.parametrize("name", STREAMS)
def test_recorded_streams_pass_whole_with_their_usage_told(name: str, size: int) -> None:
    recorded = _load(name)
    route = Route(recorded["endpoint"])
    api = api_of(route)
    body = recorded["decode_response"]["sse"].encode()
    prefill = recorded["prefill_response"]["usage"]
    events = WholeEvents(api.markers, api, _Known(prefill))  # type: ignore[arg-type]
    out = _feed(events, body, size)
    assert events.ended() and not events.engine_error
    before = [e for e in body.split(b"\n\n") if e]
    after = [e for e in out.split(b"\n\n") if e]
    assert len(before) == len(after)
    changed = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    # At most the one usage event differs, and in its usage only.
    assert len(changed) <= 1
    for old, new in changed:
        old_data = json.loads(old.split(b"data: ", 1)[1])
        new_data = json.loads(new.split(b"data: ", 1)[1])
        holder_old = old_data.get("response", old_data)
        holder_new = new_data.get("response", new_data)
        assert holder_new["usage"] == api.true_usage(holder_old["usage"], prefill)
        holder_new["usage"] = holder_old["usage"]
        assert new_data == old_data
    if route in (Route.RESPONSES, Route.MESSAGES, Route.CHAT):
        assert changed  # their cold decode reports no cache writes: the rule tells them


@pytest.mark.parametrize(("case", "engine_error", "ended"), [
    ("messages_stream", True, True),   # its error event is the stream's last
    ("generate_stream", True, True),   # error event, then [DONE]
    ("chat_stream", True, True),
    ("responses_stream", False, False),  # vLLM cuts it: not an end
])
def test_recorded_failures_are_recognised(case: str, engine_error: bool, ended: bool) -> None:
    reply = _load("errors_midstream")["cases"][case]
    route = Route(reply["endpoint"])
    api = api_of(route)
    events = WholeEvents(api.markers, api)
    _feed(events, reply["reply"]["body"].encode(), 5)
    assert (events.engine_error, events.ended()) == (engine_error, ended)


def test_a_waiting_usage_event_is_resumed() -> None:
    api = api_of(Route.MESSAGES)
    recorded = _load("messages_nixl_stream")

    class Later(_Known):
        pass

    usage = Later(recorded["prefill_response"]["usage"])
    usage.pending = True
    events = WholeEvents(api.markers, api, usage)  # type: ignore[arg-type]
    body = recorded["decode_response"]["sse"].encode()
    head, tail = body.split(b"event: message_delta", 1)
    assert events.take(head) == head
    # message_start carries usage too, but not the one told: it does not wait.
    assert events.take(b"event: message_delta" + tail) is None
    assert events.waiting
    resumed = asyncio.run(events.resume())
    delta = json.loads(resumed.split(b"data: ", 1)[1].split(b"\n", 1)[0])
    assert delta["usage"]["cache_creation_input_tokens"] == 192  # the prefill's write
    assert resumed.endswith(b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n")


# -- bodies, state, errors, prompt lengths ------------------------------------------------


def _raw(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


@pytest.mark.parametrize(("route", "body", "says"), [
    (Route.MESSAGES, {"messages": [{"role": "user", "content": "x"}]}, "'max_tokens' is"),
    (Route.MESSAGES, {"messages": [], "max_tokens": 3}, "'messages'"),
    (Route.MESSAGES, {"messages": [{"role": "user"}], "max_tokens": 0}, "positive"),
    (Route.RESPONSES, {"input": 5}, "'input'"),
    (Route.RESPONSES, {"input": "x", "store": "yes"}, "'store'"),
    (Route.RESPONSES, {"input": "x", "max_output_tokens": 1.5}, "'max_output_tokens'"),
    (Route.GENERATE, {"token_ids": ["a"]}, "'token_ids'"),
    (Route.GENERATE, {"token_ids": [1], "sampling_params": []}, "'sampling_params'"),
    (Route.GENERATE, {"token_ids": [1], "sampling_params": {"max_tokens": "2"}},
     "'sampling_params.max_tokens'"),
    (Route.GENERATE, {"token_ids": [1], "sampling_params": {"n": 3}}, "'sampling_params.n'"),
])
def test_new_routes_refuse_wrong_fields(route: Route, body: dict[str, Any], says: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_client_body(_raw(body), route)
    assert says in info.value.message


def test_new_routes_do_not_fan_out() -> None:
    for route, body in ((Route.RESPONSES, {"input": "x", "n": 4}),
                        (Route.MESSAGES, {"messages": [{"role": "user"}], "max_tokens": 2,
                                          "n": 4}),
                        (Route.GENERATE, {"token_ids": [1, 2], "n": 4})):
        assert parse_client_body(_raw(body), route).sub_requests == 1


def test_duplicated_keys_of_the_new_apis_are_refused() -> None:
    raw = b'{"input": "x", "max_output_tokens": 1, "max_output_tokens": 900}'
    with pytest.raises(InvalidRequest, match="duplicated"):
        parse_client_body(raw, Route.RESPONSES)


@pytest.mark.parametrize(("body", "why"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"background": False, "store": True}, None),
])
def test_responses_state_rule(body: dict[str, Any], why: str | None) -> None:
    assert api_of(Route.RESPONSES).runs_whole({"input": "x", **body}) == why


def test_error_shapes() -> None:
    error = DecodeFailed("decode engine broke its stream")
    assert api_of(Route.RESPONSES).error_body(error) == {"error": {
        "message": error.message, "type": "decode_error", "code": "decode_failed"}}
    assert api_of(Route.MESSAGES).error_body(error) == {"type": "error", "error": {
        "type": "api_error", "message": error.message, "code": "decode_failed",
        "stage": "decode"}}
    event = api_of(Route.RESPONSES).stream_error(error, b'..."sequence_number":41,"type":"x"}')
    assert event.startswith(b"event: error\ndata: ") and event.endswith(b"\n\n")
    assert json.loads(event.split(b"data: ", 1)[1])["sequence_number"] == 42
    assert api_of(Route.MESSAGES).stream_error(error).startswith(b"event: error\ndata: ")
    assert api_of(Route.GENERATE).stream_error(error).startswith(b'data: {"error"')


def test_prompt_lengths_of_the_new_routes() -> None:
    assert exact_tokens(Route.GENERATE, {"token_ids": [1, 2, 3]}) == 3
    assert exact_tokens(Route.RESPONSES, {"input": "abcd"}) is None
    assert estimate_tokens(Route.RESPONSES, {"input": "abcdefgh"}) == 2 + 4
    items = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "abcd"}]}],
             "instructions": "abcd"}
    assert estimate_tokens(Route.RESPONSES, items) == 2 + 4
    messages = {"system": "abcd", "messages": [{"role": "user", "content": "abcd"}]}
    assert estimate_tokens(Route.MESSAGES, messages) == 2 + 4
