"""The TensorRT-LLM stub: context_only / generation_only hand-off and strict request models.

Proves: a context response carries disaggregated_params (in choices[0]) and prompt_token_ids
(top level) in TRT-LLM's shape; a generation request with those params, as the contract
builds it, gives the remote output starting with first_gen_tokens; a tampered opaque state,
another prompt or missing params give the local output; unknown fields are a 400 like
trtllm-serve's. Does not prove TRT-LLM's real opaque-state encoding.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from stub_builders import chat, completion, sse_events

from sidecar.tools.stubs import is_local_text, is_remote_text, run_stub


async def post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with session.post(url, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


CTX = {"request_type": "context_only", "disagg_request_id": 4398046511104 + 12345}


async def test_completion_context_then_generation(session: aiohttp.ClientSession) -> None:
    async with (
        run_stub(engine="trtllm", role="prefill") as c,
        run_stub(engine="trtllm", role="decode") as g,
    ):
        body = completion("trt prompt", max_tokens=5)
        status, ctx = await post(
            session,
            c.url + "/v1/completions",
            {**body, "max_tokens": 1, "disaggregated_params": CTX},
        )
        assert status == 200, ctx
        params = ctx["choices"][0]["disaggregated_params"]
        assert params["request_type"] == "context_only"
        assert params["ctx_request_id"] == CTX["disagg_request_id"]  # ids above 2**53 stay exact
        assert params["disagg_request_id"] == CTX["disagg_request_id"]
        assert (
            isinstance(params["encoded_opaque_state"], str) and len(params["first_gen_tokens"]) == 1
        )
        assert ctx["prompt_token_ids"] == [b + 3 for b in b"trt prompt"]
        assert ctx["choices"][0]["finish_reason"] == "length"

        gen_body = {
            **body,
            "prompt": ctx["prompt_token_ids"],
            "disaggregated_params": {**params, "request_type": "generation_only"},
        }
        status, out = await post(session, g.url + "/v1/completions", gen_body)
        assert status == 200, out
        assert is_remote_text(out["choices"][0]["text"])
        assert out["choices"][0]["text"].startswith(ctx["choices"][0]["text"])
        assert (await g.recorder.next_decision()).reason == "ok"

        async with session.post(
            g.url + "/v1/completions", json={**gen_body, "stream": True}
        ) as resp:
            events = sse_events(await resp.text())
        assert events[-1] == "[DONE]"
        assert is_remote_text("".join(e["choices"][0]["text"] for e in events[:-1]))


async def test_chat_context_then_generation(session: aiohttp.ClientSession) -> None:
    async with (
        run_stub(engine="trtllm", role="prefill") as c,
        run_stub(engine="trtllm", role="decode") as g,
    ):
        body = chat("chat trt", max_tokens=4)
        _, ctx = await post(
            session,
            c.url + "/v1/chat/completions",
            {**body, "max_tokens": 1, "disaggregated_params": CTX},
        )
        params = ctx["choices"][0]["disaggregated_params"]
        gen_body = {
            **body,
            "prompt_token_ids": ctx["prompt_token_ids"],
            "disaggregated_params": {**params, "request_type": "generation_only"},
        }
        status, out = await post(session, g.url + "/v1/chat/completions", gen_body)
        assert status == 200, out
        assert is_remote_text(out["choices"][0]["message"]["content"])


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (
            lambda b, p: {**b, "disaggregated_params": {**p, "encoded_opaque_state": "c3R1Yg=="}},
            "opaque_state_mismatch",
        ),
        (
            lambda b, p: {**b, "disaggregated_params": {**p, "encoded_opaque_state": "%%%"}},
            "malformed_handoff",
        ),
        (
            lambda b, p: {
                **b,
                "disaggregated_params": {**p, "ctx_request_id": p["ctx_request_id"] + 1},
            },
            "opaque_state_mismatch",
        ),
        (lambda b, p: {**b, "prompt": [5, 6, 7]}, "opaque_state_mismatch"),
        (
            lambda b, p: {**b, "disaggregated_params": {"request_type": "generation_only"}},
            "missing_params",
        ),
        (lambda b, p: {k: v for k, v in b.items() if k != "disaggregated_params"}, "no_handoff"),
    ],
)
async def test_broken_generation_is_local(
    session: aiohttp.ClientSession, change: Any, reason: str
) -> None:
    async with (
        run_stub(engine="trtllm", role="prefill") as c,
        run_stub(engine="trtllm", role="decode") as g,
    ):
        body = completion("trt prompt", max_tokens=3)
        _, ctx = await post(
            session, c.url + "/v1/completions", {**body, "disaggregated_params": CTX}
        )
        params = {**ctx["choices"][0]["disaggregated_params"], "request_type": "generation_only"}
        gen_body = change(
            {**body, "prompt": ctx["prompt_token_ids"], "disaggregated_params": params}, params
        )
        status, out = await post(session, g.url + "/v1/completions", gen_body)
        assert status == 200, out
        assert is_local_text(out["choices"][0]["text"])
        assert (await g.recorder.next_decision()).reason == reason


@pytest.mark.parametrize(
    ("path", "body", "fragment"),
    [
        ("/v1/completions", completion(kv_transfer_params={}), "kv_transfer_params"),
        ("/v1/completions", completion(max_completion_tokens=3), "max_completion_tokens"),
        ("/v1/completions", completion(disaggregated_params={**CTX, "bogus": 1}), "bogus"),
        (
            "/v1/completions",
            completion(disaggregated_params={"request_type": "sideways"}),
            "request_type",
        ),
        ("/v1/chat/completions", chat(bootstrap_room=1), "bootstrap_room"),
        ("/v1/completions", {"prompt": "no model"}, "model"),
        ("/v1/completions", completion(stream=True, disaggregated_params=CTX), "stream"),
    ],
)
async def test_strict_models_reject(
    session: aiohttp.ClientSession, path: str, body: Any, fragment: str
) -> None:
    async with run_stub(engine="trtllm") as s:
        status, out = await post(session, s.url + path, body)
    assert status == 400
    assert out["object"] == "error" and out["type"] == "BadRequestError" and out["code"] == 400
    assert fragment in out["message"]


async def test_no_handoff_fault_drops_params(session: aiohttp.ClientSession) -> None:
    async with run_stub(engine="trtllm", role="prefill") as c:
        c.faults.add("no_handoff", times=1)
        _, ctx = await post(
            session, c.url + "/v1/completions", completion(disaggregated_params=CTX)
        )
        assert ctx["choices"][0]["disaggregated_params"] is None
        _, ctx = await post(
            session, c.url + "/v1/completions", completion(disaggregated_params=CTX)
        )
        assert ctx["choices"][0]["disaggregated_params"] is not None
