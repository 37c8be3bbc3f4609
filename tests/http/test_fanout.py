"""Proves the fan-out of ``n > 1`` and batched prompts through the HTTP front door, for every
engine/connector pair x shape (n, batch, both) x JSON/streamed, over real sockets:

- each (prompt, choice) runs as its own PD pair: every prefill and decode body carries its own
  hand-off (rooms, transfer ids, disagg ids, kv_transfer_params all distinct) and its own
  request id ``<id>-<k>``, and is otherwise the client's body with that prompt and ``n`` 1;
  every decode used its prefill's KV (the stubs' verdict);
- the merged answer is the engine's own shape: choices indexed ``i * n + j``, each equal to
  the single-request answer for its prompt, one id, usage summed (prompt tokens once per
  prompt); streams interleave the legs with the index rewritten and end with one usage chunk
  (when asked) and one ``[DONE]``;
- the cap (``--max-fanout``) and the refused fields give 400 and reach no engine; a seed is
  derived per choice;
- a failing sub-request fails the request (before the first byte: its status; after: one
  error event, no ``[DONE]``) and every other sub-request ends on both engines; a client that
  goes away ends them all.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import aiohttp
import pytest
from pd_builders import PAIRS, client_body, metric_reaches, pd_pair, sse_events
from protocol_builders import HANDOFF_FIELDS

from sidecar.protocol.context import Route
from sidecar.tools.stubs.faults import Fault, FaultKind
from sidecar.tools.stubs.textgen import is_remote_text

PROMPTS = ["Disaggregated serving splits prefill and decode.", "A second, different prompt."]
#: Fields only the hand-off (or the engine's token-id rules) set on a leg's body.
LEG_FIELDS = frozenset({*HANDOFF_FIELDS, "rid"})

#: shape name -> (route, extra client fields, number of prompts, n)
SHAPES: dict[str, tuple[Route, dict[str, Any], int, int]] = {
    "n3": (Route.COMPLETIONS, {"n": 3}, 1, 3),
    "chat-n3": (Route.CHAT, {"n": 3}, 1, 3),
    "batch2": (Route.COMPLETIONS, {"prompt": PROMPTS}, 2, 1),
    "batch2-n2": (Route.COMPLETIONS, {"prompt": PROMPTS, "n": 2}, 2, 2),
}


def _prompt_of(shape: str, index: int) -> str:
    return PROMPTS[index] if SHAPES[shape][2] > 1 else PROMPTS[0]


def _without_leg_fields(body: dict[str, Any], engine: str) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k not in LEG_FIELDS}
    if engine == "trtllm":  # TensorRT-LLM's decode prompt is the context's token ids
        out.pop("prompt", None)
        out.pop("prompt_token_ids", None)
    return out


def _choice_text(choice: dict[str, Any]) -> str:
    return str(choice.get("text") or (choice.get("message") or choice.get("delta") or {})
               .get("content") or "")


def _inference(stub: Any) -> int:
    """Requests a stub received on the OpenAI routes (not health checks, nor the sidecar's
    GET /v1/models: what it serves)."""
    return len([r for r in stub.recorder.requests
                if r.method == "POST" and r.path.startswith("/v1/")])


async def _single(pair: Any, route: Route, prompt: str) -> dict[str, Any]:
    """The JSON answer to the same request with one prompt and n 1."""
    status, _, text = await pair.send(route, body=client_body(route, prompt=prompt))
    assert status == 200, text
    answer: dict[str, Any] = json.loads(text)
    return answer


async def _legs(pair: Any, route: Route, count: int) -> tuple[list[Any], list[Any]]:
    prefills = [await pair.prefill.recorder.next_request(route.value) for _ in range(count)]
    decodes = [await pair.decode.recorder.next_request(route.value) for _ in range(count)]
    return prefills, decodes


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize(("engine", "connector"), PAIRS, ids=[f"{e}-{c}" for e, c in PAIRS])
async def test_fanout(engine: str, connector: str, shape: str, stream: bool) -> None:
    route, extra, prompts, n = SHAPES[shape]
    count = prompts * n
    async with pd_pair(engine, connector) as pair:
        singles = [await _single(pair, route, prompt) for prompt in PROMPTS[:prompts]]
        await _legs(pair, route, prompts)  # the singles' legs, not asserted here
        for _ in range(prompts):
            await pair.decode.recorder.next_decision()

        client = client_body(route, stream=stream, **extra)
        if stream:
            client["stream_options"] = {"include_usage": True}
        status, headers, text = await pair.send(route, body=client,
                                                headers={"X-Request-Id": "req-f"})
        assert status == 200, text
        assert headers["X-Request-Id"] == "req-f"

        prefills, decodes = await _legs(pair, route, count)
        ids = {f"req-f-{k}" for k in range(count)}
        assert {r.headers.get("X-Request-Id") for r in prefills} == ids
        assert {r.headers.get("X-Request-Id") for r in decodes} == ids
        # Each decode carries its own hand-off; apart from it, the client's body per prompt.
        handoffs = {json.dumps({k: v for k, v in r.json.items() if k in LEG_FIELDS},
                               sort_keys=True) for r in decodes}
        assert len(handoffs) == count
        if engine == "sglang":
            assert len({r.json["bootstrap_room"] for r in prefills}) == count
        expected = []
        for k in range(count):
            body = dict(client)
            if prompts > 1:
                body["prompt"] = PROMPTS[k // n]
            if "n" in body:
                body["n"] = 1
            expected.append(json.dumps(_without_leg_fields(body, engine), sort_keys=True))
        seen = [json.dumps(_without_leg_fields(r.json, engine), sort_keys=True) for r in decodes]
        assert sorted(seen) == sorted(expected)
        for request in prefills:
            assert request.json["max_tokens"] == 1 and request.json["stream"] is False
        for _ in range(count):
            decision = await pair.decode.recorder.next_decision()
            assert (decision.outcome, decision.reason) == ("remote", "ok")

        texts: dict[int, str] = defaultdict(str)
        if stream:
            events = sse_events(text)
            assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
            chunks = [json.loads(e) for e in events[:-1]]
            assert len({c["id"] for c in chunks}) == 1
            usage_chunks = [c for c in chunks if c.get("usage")]
            assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1]
            usage = usage_chunks[0]["usage"]
            for chunk in chunks:
                for choice in chunk["choices"]:
                    texts[choice["index"]] += _choice_text(choice)
        else:
            answer = json.loads(text)
            assert [c["index"] for c in answer["choices"]] == list(range(count))
            for choice in answer["choices"]:
                texts[choice["index"]] = _choice_text(choice)
            usage = answer["usage"]
        assert sorted(texts) == list(range(count))
        for k in range(count):
            single = singles[k // n if prompts > 1 else 0]
            assert texts[k] == _choice_text(single["choices"][0])
            assert is_remote_text(texts[k])
        single_usage = [s["usage"] for s in singles]
        assert usage["prompt_tokens"] == sum(u["prompt_tokens"] for u in single_usage)
        assert usage["completion_tokens"] == n * sum(u["completion_tokens"] for u in single_usage)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

        assert await pair.sidecar.metric("disagg_requests_total", route=route.value,
                                         outcome="ok") == prompts + 1
        assert await pair.sidecar.metric("disagg_inflight_requests", front_door="http") == 0


async def test_over_the_cap_is_refused_naming_it_and_reaches_no_engine() -> None:
    async with pd_pair("vllm", "shfs", max_fanout=4) as pair:
        status, _, text = await pair.send(body=client_body(n=5))
        assert status == 400, text
        assert "limit is 4" in json.loads(text)["error"]["message"]
        status, _, text = await pair.send(body=client_body(n=2, prompt=PROMPTS))
        assert status == 200, text  # 2 x 2 = 4 is within the cap
        assert _inference(pair.prefill) == 4


@pytest.mark.parametrize("extra", [
    {"best_of": 3}, {"prompt_logprobs": 1},
    {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
], ids=["best_of", "prompt_logprobs", "continuous_usage"])
async def test_fields_that_cannot_merge_are_refused(extra: dict[str, Any]) -> None:
    async with pd_pair("vllm", "shfs") as pair:
        status, _, text = await pair.send(body=client_body(n=3, **extra))
        assert status == 400, text
        assert "not supported with n > 1" in json.loads(text)["error"]["message"]
        assert _inference(pair.prefill) == 0 and _inference(pair.decode) == 0


async def test_each_choice_gets_a_derived_seed_and_echo_works_per_prompt() -> None:
    async with pd_pair("vllm", "shfs") as pair:
        status, _, text = await pair.send(body=client_body(n=3, seed=7, prompt=PROMPTS))
        assert status == 200, text
        decodes = [await pair.decode.recorder.next_request("/v1/completions")
                   for _ in range(6)]
        seeds = sorted((r.json["prompt"], r.json["seed"]) for r in decodes)
        assert seeds == sorted((p, s) for p in PROMPTS for s in (7, 8, 9))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize(("engine", "connector"), PAIRS, ids=[f"{e}-{c}" for e, c in PAIRS])
async def test_a_failing_sub_request_fails_the_request_and_cancels_the_others(
    engine: str, connector: str, stream: bool
) -> None:
    # The decode engine refuses the first of three decodes; the two others would take 20 s
    # (100 tokens, 0.2 s apart): they end only because the sidecar cancels them, and the
    # stubs' idle wait (10 s) would fail otherwise.
    async with pd_pair(engine, connector, decode_overrides={"itl_s": 0.2, "faults": (
            Fault(kind=FaultKind.STATUS, status=500, times=1),)}) as pair:
        status, _, text = await pair.send(body=client_body(n=3, max_tokens=100, stream=stream))
        assert status == 502, text
        assert json.loads(text)["error"]["code"] == "decode_failed"
        await pair.decode.wait_idle()
        await pair.prefill.wait_idle()
        assert pair.decode.recorder.in_flight == 0 and pair.prefill.recorder.in_flight == 0
        decodes = _inference(pair.decode)
        assert pair.decode.recorder.cancelled == decodes - 1  # all but the refused one
        await metric_reaches(pair.sidecar, "disagg_inflight_requests", 0, front_door="http")
        # The same sidecar then serves a fan-out.
        status, _, text = await pair.send(body=client_body(n=2, max_tokens=2))
        assert status == 200, text


async def test_a_prefill_failure_fails_the_request() -> None:
    async with pd_pair("vllm", "shfs", prefill_overrides={"faults": (
            Fault(kind=FaultKind.STATUS, status=503, times=1),)}) as pair:
        status, _, text = await pair.send(body=client_body(prompt=PROMPTS))
        assert status == 502, text
        assert json.loads(text)["error"]["code"] == "prefill_failed"
        await pair.decode.wait_idle()
        assert pair.decode.recorder.in_flight == 0


async def test_a_stream_broken_after_the_first_byte_ends_with_one_error_event() -> None:
    async with pd_pair("vllm", "shfs", decode_overrides={"faults": (
            Fault(kind=FaultKind.DROP, after_chunks=2, times=1),)}) as pair:
        async with aiohttp.ClientSession() as session:
            response = await session.post(pair.sidecar.url + "/v1/completions",
                                          json=client_body(n=3, stream=True),
                                          headers={"x-prefiller-host-port": pair.target})
            assert response.status == 200
            text = ""
            with pytest.raises(aiohttp.ClientPayloadError):  # unterminated on purpose
                async for chunk in response.content.iter_any():
                    text += chunk.decode()
        events = sse_events(text)
        assert "[DONE]" not in events
        assert json.loads(events[-1])["error"]["code"] == "decode_failed"
        await pair.decode.wait_idle()
        assert pair.decode.recorder.in_flight == 0
        await metric_reaches(pair.sidecar, "disagg_requests_total", 1, outcome="broken_stream")


@pytest.mark.parametrize(("engine", "connector"), PAIRS, ids=[f"{e}-{c}" for e, c in PAIRS])
async def test_a_client_that_goes_away_ends_every_sub_request(
    engine: str, connector: str
) -> None:
    # Slow decodes: the client reads its first event, then leaves while all three stream.
    async with pd_pair(engine, connector, decode_overrides={"itl_s": 0.2}) as pair:
        body = client_body(n=3, stream=True, max_tokens=200)
        async with aiohttp.ClientSession() as session:
            response = await session.post(pair.sidecar.url + "/v1/completions", json=body,
                                          headers={"x-prefiller-host-port": pair.target})
            assert response.status == 200
            await response.content.readuntil(b"\n\n")
            response.close()
        await pair.decode.wait_idle()
        assert pair.decode.recorder.in_flight == 0
        assert pair.decode.recorder.cancelled == 3
        await metric_reaches(pair.sidecar, "disagg_requests_total", 1, outcome="cancelled")
        assert await pair.sidecar.metric("disagg_inflight_requests", front_door="http") == 0


async def test_single_requests_stay_single() -> None:
    # A one-item prompt array and n 1 are one PD pair with the client's body, as before.
    async with pd_pair("vllm", "shfs") as pair:
        body = client_body(prompt=[PROMPTS[0]], n=1)
        status, _, text = await pair.send(body=body, headers={"X-Request-Id": "one"})
        assert status == 200, text
        decode = await pair.decode.recorder.next_request("/v1/completions")
        assert decode.headers.get("X-Request-Id") == "one"
        assert decode.json["prompt"] == [PROMPTS[0]] and decode.json["n"] == 1
        assert _inference(pair.prefill) == 1
