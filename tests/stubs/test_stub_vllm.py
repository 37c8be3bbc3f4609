"""The vLLM stub: OpenAI shapes, and the NIXL (shfs), Neuron (nixl) and Mooncake P->D flows.

Proves: a correct hand-off gives the "remote" output (the prefill's first token is the
decode's first token); every broken hand-off (reused params, wrong port, other prompt,
missing keys, none at all, Mooncake without its push) gives the visibly different local
output and a recorded verdict; Mooncake pairs by transfer_id in either arrival order; vLLM's
400s for bodies it refuses. Does not prove byte-equality with a real vLLM (see real_vllm).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from stub_builders import NIXL_PREFILL_PARAMS, chat, completion, sse_events

from sidecar.dialects.vllm_mooncake import engine_id_from_query
from sidecar.tools.stubs import expected_text, is_local_text, is_remote_text, run_stub
from sidecar.tools.stubs.textgen import encode_text


async def post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with session.post(url, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


async def nixl_prefill(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    status, data = await post(
        session,
        url + "/v1/completions",
        {**body, "max_tokens": 1, "kv_transfer_params": NIXL_PREFILL_PARAMS},
    )
    assert status == 200, data
    return data


async def test_nixl_correct_handoff_gives_remote_output(session: aiohttp.ClientSession) -> None:
    async with (
        run_stub(engine="vllm", role="prefill") as p,
        run_stub(engine="vllm", role="decode") as d,
    ):
        body = completion("The quick brown fox", max_tokens=5)
        pre = await nixl_prefill(session, p.url, body)
        params = pre["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["remote_engine_id"] == p.engine_id
        assert params["remote_host"] == "localhost" and params["remote_port"] == p.port
        assert params["remote_block_ids"] == [[1, 2]]  # 19 prompt tokens, block size 16
        assert params["tp_size"] == 1 and params["remote_num_tokens"] == 19
        assert params["remote_request_id"].startswith(pre["id"] + "-0-")
        assert p.engine.connector.held() == 1

        status, out = await post(
            session, d.url + "/v1/completions", {**body, "kv_transfer_params": params}
        )
        assert status == 200
        text = out["choices"][0]["text"]
        assert is_remote_text(text)
        assert text == expected_text(encode_text("The quick brown fox"), 5)
        assert text.startswith(pre["choices"][0]["text"])
        assert out["kv_transfer_params"] is None
        assert p.engine.connector.held() == 0  # pulled, blocks freed
        decision = await d.recorder.next_decision()
        assert (decision.outcome, decision.reason) == ("remote", "ok")

        # The same hand-off twice: the blocks are gone, decode recomputes locally.
        status, again = await post(
            session, d.url + "/v1/completions", {**body, "kv_transfer_params": params}
        )
        assert is_local_text(again["choices"][0]["text"])
        assert (await d.recorder.next_decision()).reason == "unknown_request"


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda p, q: {**p, "remote_port": q}, "pull_failed"),
        (lambda p, q: {**p, "remote_engine_id": "someone-else"}, "engine_mismatch"),
        (lambda p, q: {**p, "remote_block_ids": [[7, 8]]}, "block_mismatch"),
        (lambda p, q: {k: v for k, v in p.items() if k != "remote_request_id"}, "missing_params"),
        (lambda p, q: {k: v for k, v in p.items() if k != "remote_host"}, "missing_params"),
    ],
)
async def test_nixl_broken_handoff_gives_local_output(
    session: aiohttp.ClientSession, mutate: Any, reason: str
) -> None:
    async with (
        run_stub(engine="vllm", role="prefill") as p,
        run_stub(engine="vllm", role="decode") as d,
        run_stub(engine="vllm", role="decode") as other,
    ):
        body = completion()
        params = (await nixl_prefill(session, p.url, body))["kv_transfer_params"]
        # `other` listens but has no such request: a wrong port that answers.
        broken = mutate(params, other.port)
        status, out = await post(
            session, d.url + "/v1/completions", {**body, "kv_transfer_params": broken}
        )
        assert status == 200
        assert is_local_text(out["choices"][0]["text"])
        decision = await d.recorder.next_decision()
        assert decision.outcome == "local"
        assert decision.reason in (reason, "unknown_request")


async def test_nixl_mismatched_prompt_and_flat_block_ids(session: aiohttp.ClientSession) -> None:
    async with (
        run_stub(engine="vllm", role="prefill") as p,
        run_stub(engine="vllm", role="decode") as d,
    ):
        params = (await nixl_prefill(session, p.url, completion("one prompt")))[
            "kv_transfer_params"
        ]
        _, out = await post(
            session,
            d.url + "/v1/completions",
            completion("another prompt", kv_transfer_params=params),
        )
        assert is_local_text(out["choices"][0]["text"])
        assert (await d.recorder.next_decision()).reason == "prompt_mismatch"

        params = (await nixl_prefill(session, p.url, completion("one prompt")))[
            "kv_transfer_params"
        ]
        flat = {**params, "remote_block_ids": params["remote_block_ids"][0]}  # old vLLM shape
        _, out = await post(
            session, d.url + "/v1/completions", completion("one prompt", kv_transfer_params=flat)
        )
        assert is_remote_text(out["choices"][0]["text"])


async def test_decode_without_handoff_is_local_and_counted(session: aiohttp.ClientSession) -> None:
    async with run_stub(engine="vllm", role="decode") as d:
        _, out = await post(session, d.url + "/v1/completions", completion())
        assert is_local_text(out["choices"][0]["text"])
        assert (await d.recorder.next_decision()).reason == "no_handoff"
        async with session.get(d.url + "/metrics") as resp:
            text = await resp.text()
        assert 'stub_handoff_total{outcome="local",reason="no_handoff"} 1' in text


async def test_prefill_hold_expires_and_stream_has_no_params(
    session: aiohttp.ClientSession,
) -> None:
    async with run_stub(engine="vllm", role="prefill", kv_lease_s=0.0) as p:
        body = completion(max_tokens=1, kv_transfer_params=NIXL_PREFILL_PARAMS)
        _, out = await post(session, p.url + "/v1/completions", body)
        assert out["kv_transfer_params"] is not None
        assert p.engine.connector.held() == 0  # lease 0: expired at once
        async with session.post(p.url + "/v1/completions", json={**body, "stream": True}) as resp:
            events = sse_events(await resp.text())
        assert all("kv_transfer_params" not in e for e in events if isinstance(e, dict))


async def test_same_request_same_output_and_chat(session: aiohttp.ClientSession) -> None:
    async with run_stub(engine="vllm", role="both") as s:
        a = (await post(session, s.url + "/v1/completions", completion([5, 6, 7])))[1]
        b = (await post(session, s.url + "/v1/completions", completion([5, 6, 7])))[1]
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
        assert a["choices"][0]["finish_reason"] == "length"
        assert a["usage"] == {
            "prompt_tokens": 3,
            "total_tokens": 9,
            "completion_tokens": 6,
            "prompt_tokens_details": None,
        }
        status, c = await post(
            session, s.url + "/v1/chat/completions", chat(max_completion_tokens=3)
        )
        assert status == 200
        assert c["object"] == "chat.completion" and c["id"].startswith("chatcmpl-")
        assert c["choices"][0]["message"]["role"] == "assistant"
        assert len(c["choices"][0]["message"]["content"].split()) == 3


async def test_stream_shapes_usage_and_token_ids(session: aiohttp.ClientSession) -> None:
    async with run_stub(engine="vllm", role="both") as s:
        body = completion(
            [9, 8, 7],
            max_tokens=3,
            stream=True,
            return_token_ids=True,
            stream_options={"include_usage": True},
        )
        async with session.post(
            s.url + "/v1/completions", json=body, headers={"X-Request-Id": "r1"}
        ) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            events = sse_events(await resp.text())
        assert events[-1] == "[DONE]"
        tokens = events[:3]
        assert [e["id"] for e in tokens] == ["cmpl-r1"] * 3
        assert tokens[0]["choices"][0]["prompt_token_ids"] == [9, 8, 7]
        assert all(len(e["choices"][0]["token_ids"]) == 1 for e in tokens)
        assert [e["choices"][0]["finish_reason"] for e in tokens] == [None, None, "length"]
        assert events[3]["choices"] == [] and events[3]["usage"]["completion_tokens"] == 3

        async with session.post(
            s.url + "/v1/chat/completions", json=chat(max_tokens=2, stream=True)
        ) as resp:
            events = sse_events(await resp.text())
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert events[-1] == "[DONE]"

        _, out = await post(
            session, s.url + "/v1/completions", completion([1, 2], return_token_ids=True)
        )
        assert out["choices"][0]["prompt_token_ids"] == [1, 2]
        assert len(out["choices"][0]["token_ids"]) == 6


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (completion(n=2), "n=1"),
        (completion(stream_options={"include_usage": True}), "stream=True"),
        (completion(min_tokens=9, max_tokens=2), "min_tokens"),
        (completion(["a", "b"]), "one prompt"),
        (completion(max_tokens=5000), "maximum context length"),
        ({"model": "m"}, "prompt"),
        (completion(kv_transfer_params=[1]), "kv_transfer_params"),
    ],
)
async def test_vllm_refusals(session: aiohttp.ClientSession, body: Any, fragment: str) -> None:
    async with run_stub(engine="vllm") as s:
        status, out = await post(session, s.url + "/v1/completions", body)
    assert status == 400
    assert out["error"]["type"] == "BadRequestError" and out["error"]["code"] == 400
    assert fragment in out["error"]["message"]


async def test_invalid_json_models_health(session: aiohttp.ClientSession) -> None:
    async with run_stub(engine="vllm", model="m1") as s:
        async with session.post(s.url + "/v1/completions", data=b"{nope") as resp:
            assert resp.status == 400
        async with session.get(s.url + "/health") as resp:
            assert resp.status == 200 and await resp.read() == b""
        async with session.get(s.url + "/v1/models") as resp:
            assert (await resp.json())["data"][0]["id"] == "m1"
        async with session.get(s.url + "/nowhere") as resp:
            assert resp.status == 404 and await resp.json() == {"detail": "Not Found"}
        async with session.get(s.url + "/v1/completions") as resp:
            assert resp.status == 405 and await resp.json() == {"detail": "Method Not Allowed"}


async def test_neuron_handoff(session: aiohttp.ClientSession) -> None:
    async with (
        run_stub(engine="vllm", role="prefill", kv_connector="nixl") as p,
        run_stub(engine="vllm", role="decode", kv_connector="nixl") as d,
    ):
        body = chat("neuron prompt", max_tokens=4)
        _, pre = await post(session, p.url + "/v1/chat/completions", {**body, "max_tokens": 1})
        _, out = await post(
            session, d.url + "/v1/chat/completions", {**body, "disagg_prefill_resp": pre}
        )
        assert is_remote_text(out["choices"][0]["message"]["content"])
        assert (await d.recorder.next_decision()).reason == "ok"

        _, out = await post(
            session,
            d.url + "/v1/chat/completions",
            {**chat("other", max_tokens=4), "disagg_prefill_resp": pre},
        )
        assert is_local_text(out["choices"][0]["message"]["content"])
        assert (await d.recorder.next_decision()).reason == "prompt_mismatch"
        _, out = await post(
            session, d.url + "/v1/chat/completions", {**body, "disagg_prefill_resp": "x"}
        )
        assert (await d.recorder.next_decision()).reason == "malformed_handoff"


def mooncake_bodies(
    p_boot: str, engine_id: str, transfer_id: str, prompt: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    pre = completion(
        prompt,
        max_tokens=1,
        kv_transfer_params={
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": transfer_id,
        },
    )
    dec = completion(
        prompt,
        max_tokens=4,
        kv_transfer_params={
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "transfer_id": transfer_id,
            "remote_bootstrap_addr": p_boot,
            "remote_engine_id": engine_id,
        },
    )
    return pre, dec


@pytest.mark.parametrize("decode_first", [False, True])
@pytest.mark.parametrize("shape", ["dp_rank", "engine_id"])
async def test_mooncake_pairs_in_either_order(
    session: aiohttp.ClientSession, decode_first: bool, shape: str
) -> None:
    async with (
        run_stub(
            engine="vllm", role="prefill", kv_connector="mooncake", mooncake_query_shape=shape
        ) as p,
        run_stub(engine="vllm", role="decode", kv_connector="mooncake") as d,
    ):
        assert p.bootstrap_url is not None
        async with session.get(p.bootstrap_url + "/query") as resp:
            query = await resp.json()
        if shape == "dp_rank":
            assert query["0"]["engine_id"] == p.engine_id
        else:
            assert p.engine_id in query
        assert engine_id_from_query(query) == p.engine_id  # the agent reads either shape
        pre, dec = mooncake_bodies(p.bootstrap_url, p.engine_id, "xfer-1", "mooncake prompt")
        if decode_first:
            decode = asyncio.create_task(post(session, d.url + "/v1/completions", dec))
            # The decode is parked on the prefill's bootstrap server before the prefill runs.
            await p.bootstrap_recorder.next_request("/_stub/mooncake/xfer-1")
            prefill = await post(session, p.url + "/v1/completions", pre)
            status, out = await decode
        else:
            prefill = await post(session, p.url + "/v1/completions", pre)
            status, out = await post(session, d.url + "/v1/completions", dec)
        assert prefill[0] == 200 and prefill[1]["kv_transfer_params"] is None
        assert status == 200 and is_remote_text(out["choices"][0]["text"])
        assert out["choices"][0]["text"].startswith(prefill[1]["choices"][0]["text"])


async def test_mooncake_broken_handoffs(session: aiohttp.ClientSession) -> None:
    async with (
        run_stub(engine="vllm", role="prefill", kv_connector="mooncake") as p,
        run_stub(
            engine="vllm", role="decode", kv_connector="mooncake", waiting_timeout_s=0.05
        ) as d,
    ):
        assert p.bootstrap_url is not None
        # No prefill ever pushes this transfer: bounded wait, then local.
        _, dec = mooncake_bodies(p.bootstrap_url, p.engine_id, "xfer-lost", "p")
        _, out = await post(session, d.url + "/v1/completions", dec)
        assert is_local_text(out["choices"][0]["text"])
        assert (await d.recorder.next_decision()).reason == "transfer_timeout"
        # Wrong engine id.
        pre, dec = mooncake_bodies(p.bootstrap_url, "nobody", "xfer-2", "p")
        await post(session, p.url + "/v1/completions", pre)
        _, out = await post(session, d.url + "/v1/completions", dec)
        assert (await d.recorder.next_decision()).reason == "engine_mismatch"
        # Missing keys.
        del dec["kv_transfer_params"]["remote_bootstrap_addr"]
        await post(session, d.url + "/v1/completions", dec)
        assert (await d.recorder.next_decision()).reason == "missing_params"
        # Other prompt.
        pre, dec = mooncake_bodies(p.bootstrap_url, p.engine_id, "xfer-3", "p")
        await post(session, p.url + "/v1/completions", pre)
        await post(session, d.url + "/v1/completions", {**dec, "prompt": "q"})
        assert (await d.recorder.next_decision()).reason == "prompt_mismatch"
        # Bootstrap server unreachable.
        pre, dec = mooncake_bodies(f"http://127.0.0.1:{d.port}", p.engine_id, "xfer-4", "p")
        await post(session, d.url + "/v1/completions", dec)
        assert (await d.recorder.next_decision()).reason == "bootstrap_failed"


async def test_side_channel_host_must_be_rewritten(session: aiohttp.ClientSession) -> None:
    """Across pods vLLM's default side-channel host is wrong; only a rewritten one works."""
    async with (
        run_stub(engine="vllm", role="prefill", side_channel_host="127.0.0.2") as p,
        run_stub(engine="vllm", role="decode") as d,
    ):
        body = completion("cross pod")
        params = (await nixl_prefill(session, p.url, body))["kv_transfer_params"]
        assert params["remote_host"] == "127.0.0.2"  # nothing listens there (stubs bind .1)
        _, out = await post(
            session, d.url + "/v1/completions", {**body, "kv_transfer_params": params}
        )
        assert is_local_text(out["choices"][0]["text"])
        assert (await d.recorder.next_decision()).reason == "pull_failed"

        params = (await nixl_prefill(session, p.url, body))["kv_transfer_params"]
        rewritten = {**params, "remote_host": "127.0.0.1"}
        _, out = await post(
            session, d.url + "/v1/completions", {**body, "kv_transfer_params": rewritten}
        )
        assert is_remote_text(out["choices"][0]["text"])
