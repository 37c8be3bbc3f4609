"""Real vLLM engines (CPU) behind the sidecar on the Responses, Messages and token-in generate
routes, with the sidecar as its own process before the NIXL decode engine and the prefill
engine named by ``x-prefiller-host-port`` (engines started with ``harness.ROUTE_FLAGS``).

Proves, per route, JSON and streamed:
- greedy output through the sidecar equals the baseline engine's (text; generate: token ids);
- the KV really moved: the decode engine's external prefix-cache hits grew by exactly the
  prompt's token count, and the prefill engine finished exactly one request; a negative
  control (the same request without a prefill target) shows the check fails when it did not;
- usage: what the sidecar tells equals the baseline's for a fresh prompt, where the decode
  leg's own answer does not (its cache writes are missing);
- Responses naming stored state runs whole on the decode engine (its own 404, no prefill);
- the OpenAI SDK's ``responses.create`` and the anthropic SDK's ``messages.create`` /
  ``messages.stream`` pointed at the sidecar get the baseline's text.

Does not prove SGLang or TensorRT-LLM (stubs do: tests/http/test_pd_routes.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from real_vllm.client import block_prompt, metric_value, post_json
from real_vllm.raw_http import RawReply, post_raw
from real_vllm.route_bodies import ROUTES, RouteSpec, with_handoff
from real_vllm.sidecar_process import PREFILL_HEADER, Sidecar, sidecar_process
from real_vllm.stack import RealVllm

NEW_ROUTES = ["responses", "messages", "generate"]
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
FINISHED = "vllm:request_success_total"
LAST_EVENT = {"responses": "event: response.completed", "messages": "event: message_stop",
              "generate": "data: [DONE]"}
SETTLE_S = 10.0


@pytest.fixture(scope="module")
def routes_sidecar(real_vllm: RealVllm, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[Sidecar]:
    yield from sidecar_process(
        tmp_path_factory.mktemp("routes-sidecar"),
        "--engine", "vllm", "--kv-connector", "shfs", "--engine-url", real_vllm.nixl.decode,
    )


def _body(real_vllm: RealVllm, spec: RouteSpec, tag: str, stream: bool = False
          ) -> dict[str, Any]:
    prompt = block_prompt(tag)
    if spec.takes_token_ids:
        ids = post_json(real_vllm.baseline + "/tokenize", {"model": "tiny", "prompt": prompt})
        return spec.client_body(list(ids["tokens"]), stream=stream)
    return spec.client_body(prompt, stream=stream)


def _through(sidecar: Sidecar, spec: RouteSpec, body: dict[str, Any],
             target: str | None) -> RawReply:
    headers = {PREFILL_HEADER: target} if target else {}
    return post_raw(sidecar.url + spec.path, body, headers=headers, timeout=120)


def _output(spec: RouteSpec, reply: RawReply, stream: bool) -> Any:
    assert reply.status == 200 and reply.complete, reply.body[:500]
    return spec.stream_output(reply.body) if stream else spec.output(reply.json())


def _prompt_tokens(usage: dict[str, Any]) -> int:
    if "prompt_tokens" in usage:
        return int(usage["prompt_tokens"])
    return int(usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
               + usage.get("cache_creation_input_tokens", 0))


def _settled(url: str, name: str, before: float, want: float) -> float:
    """The growth of a counter since ``before``, once it reached ``want`` (or the deadline:
    engines count a request a moment after answering it)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        grown = metric_value(url, name) - before
        if grown >= want or time.monotonic() > deadline:
            return grown
        # Engine counters are only observable by scraping: nothing to wait on.
        time.sleep(0.05)


def _kv_moved(real_vllm: RealVllm, send: Any, prompt_tokens: int) -> tuple[bool, Any]:
    """Send a request; whether the decode loaded the whole prompt from a single prefill."""
    decode, prefill = real_vllm.nixl.decode, real_vllm.nixl.prefill
    hits, finished = metric_value(decode, EXTERNAL_HITS), metric_value(prefill, FINISHED)
    result = send()
    grown_hits = _settled(decode, EXTERNAL_HITS, hits, prompt_tokens)
    grown_finished = _settled(prefill, FINISHED, finished, 1)
    return grown_hits == prompt_tokens and grown_finished == 1, result


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("name", NEW_ROUTES)
def test_route_through_the_sidecar_equals_baseline_and_moves_the_kv(
    real_vllm: RealVllm, routes_sidecar: Sidecar, name: str, stream: bool
) -> None:
    spec = ROUTES[name]
    body = _body(real_vllm, spec, f"routes-{name}-{stream}", stream)
    baseline = post_raw(real_vllm.baseline + spec.path, body)
    expected = _output(spec, baseline, stream)
    json_body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    prompt_tokens = _prompt_tokens(post_json(real_vllm.baseline + spec.path, json_body)["usage"])

    moved, reply = _kv_moved(real_vllm, lambda: _through(
        routes_sidecar, spec, body, real_vllm.nixl.prefill_hostport), prompt_tokens)
    assert expected
    assert _output(spec, reply, stream) == expected
    assert moved
    if stream:
        events = [e for e in reply.body.split("\n\n") if e.strip()]
        assert events[-1].startswith(LAST_EVENT[name])


@pytest.mark.parametrize("name", NEW_ROUTES)
def test_negative_control_the_kv_check_fails_without_a_prefill(
    real_vllm: RealVllm, routes_sidecar: Sidecar, name: str
) -> None:
    spec = ROUTES[name]
    body = _body(real_vllm, spec, f"routes-control-{name}")
    expected = spec.output(post_json(real_vllm.baseline + spec.path, body))
    prompt_tokens = _prompt_tokens(post_json(real_vllm.baseline + spec.path, body)["usage"])
    # No prefill target: the decode engine computes the prompt itself.
    moved, reply = _kv_moved(real_vllm, lambda: _through(routes_sidecar, spec, body, None),
                             prompt_tokens)
    assert _output(spec, reply, False) == expected
    assert not moved


@pytest.mark.parametrize("name", ["chat", "responses", "messages"])
def test_usage_through_the_sidecar_is_the_baselines(
    real_vllm: RealVllm, routes_sidecar: Sidecar, name: str
) -> None:
    spec = ROUTES[name]
    body = _body(real_vllm, spec, f"routes-usage-{name}")
    baseline = post_json(real_vllm.baseline + spec.path, body)["usage"]
    told = _through(routes_sidecar, spec, body, real_vllm.nixl.prefill_hostport).json()["usage"]
    assert told == baseline
    # The legs by hand on a fresh prompt: the decode's own usage misses the cache writes.
    fresh = _body(real_vllm, spec, f"routes-usage-legs-{name}")
    prefill = post_json(real_vllm.nixl.prefill + spec.path, spec.prefill_request(fresh))
    params = {**prefill["kv_transfer_params"], "remote_host": "127.0.0.1"}
    decode = post_json(real_vllm.nixl.decode + spec.path, with_handoff(fresh, params))
    assert decode["usage"] != post_json(real_vllm.baseline + spec.path, fresh)["usage"]


def test_responses_naming_stored_state_run_whole_on_the_decode(
    real_vllm: RealVllm, routes_sidecar: Sidecar
) -> None:
    spec = ROUTES["responses"]
    body = {**_body(real_vllm, spec, "routes-state"), "previous_response_id": "resp_earlier"}
    finished = metric_value(real_vllm.nixl.prefill, FINISHED)
    reply = _through(routes_sidecar, spec, body, real_vllm.nixl.prefill_hostport)
    # The decode engine keeps no store: its own 404 is the truthful answer.
    assert reply.status == 404, reply.body
    assert "resp_earlier" in reply.body
    assert metric_value(real_vllm.nixl.prefill, FINISHED) == finished


def test_openai_sdk_responses_create_gets_the_baselines_text(
    real_vllm: RealVllm, routes_sidecar: Sidecar
) -> None:
    prompt = block_prompt("routes-sdk-openai")
    args: dict[str, Any] = dict(model="tiny", input=prompt, max_output_tokens=12,
                                extra_body={"temperature": 0, "ignore_eos": True})
    base = openai.OpenAI(base_url=real_vllm.baseline + "/v1", api_key="unused", max_retries=0)
    expected = base.responses.create(**args).output_text
    client = openai.OpenAI(base_url=routes_sidecar.url + "/v1", api_key="unused",
                           max_retries=0, timeout=120,
                           default_headers={PREFILL_HEADER: real_vllm.nixl.prefill_hostport})
    assert expected
    assert client.responses.create(**args).output_text == expected
    streamed = "".join(e.delta for e in client.responses.create(stream=True, **args)
                       if e.type == "response.output_text.delta")
    assert streamed == expected


def test_anthropic_sdk_messages_create_gets_the_baselines_text(
    real_vllm: RealVllm, routes_sidecar: Sidecar
) -> None:
    messages = [{"role": "user", "content": block_prompt("routes-sdk-anthropic")}]
    # anthropic 2.15 has no temperature argument: greedy goes in the body.
    args: dict[str, Any] = dict(model="tiny", max_tokens=12, messages=messages,
                                extra_body={"temperature": 0})
    base = anthropic.Anthropic(base_url=real_vllm.baseline, api_key="unused", max_retries=0)
    expected = "".join(b.text for b in base.messages.create(**args).content if b.type == "text")
    client = anthropic.Anthropic(base_url=routes_sidecar.url, api_key="unused", max_retries=0,
                                 timeout=120,
                                 default_headers={PREFILL_HEADER: real_vllm.nixl.prefill_hostport})
    got = "".join(b.text for b in client.messages.create(**args).content if b.type == "text")
    assert expected
    assert got == expected
    with client.messages.stream(**args) as stream:
        assert "".join(stream.text_stream) == expected
