"""The SGLang stub: the bootstrap rendezvous, its timeouts, /abort_request, /generate shapes.

Proves: prefill and decode meet in either order and the decode answers with the remote
output; a wrong room, a wrong bootstrap port or another prompt is visible (timeout error or
local output); both sides time out with SGLang's wording; a prefill fault leaves the decode
waiting until its timeout; /abort_request ends a waiting request. Does not prove real
SGLang's KV transfer (no zmq, no Mooncake engine).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from stub_builders import completion, sse_events

from sidecar.tools.stubs import Stub, is_local_text, is_remote_text, run_stub


async def post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with session.post(url, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


def generate_body(p: Stub, room: int, text: str = "sglang prompt", **extra: Any) -> dict[str, Any]:
    return {
        "text": text,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": p.bootstrap_port,
        "bootstrap_room": room,
        **extra,
    }


@pytest.mark.parametrize("decode_first", [False, True])
async def test_rendezvous_in_either_order(
    session: aiohttp.ClientSession, decode_first: bool
) -> None:
    async with (
        run_stub(engine="sglang", role="prefill") as p,
        run_stub(engine="sglang", role="decode") as d,
    ):
        assert p.bootstrap_port and p.bootstrap_port != p.port
        body = generate_body(p, 42)
        if decode_first:
            decode = asyncio.create_task(post(session, d.url + "/generate", body))
            await p.bootstrap_recorder.next_request("/_stub/sglang/rooms/42")
            prefill = asyncio.create_task(post(session, p.url + "/generate", body))
        else:
            prefill = asyncio.create_task(post(session, p.url + "/generate", body))
            await p.recorder.next_request("/generate")
            decode = asyncio.create_task(post(session, d.url + "/generate", body))
        (p_status, p_out), (d_status, d_out) = await asyncio.gather(prefill, decode)
        assert p_status == 200 and len(p_out["output_ids"]) == 1  # prefill capped at 1 token
        assert d_status == 200 and is_remote_text(d_out["text"])
        assert d_out["text"].startswith(p_out["text"])
        assert d_out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
        assert d_out["meta_info"]["prompt_tokens"] == len("sglang prompt")
        assert (await d.recorder.next_decision()).reason == "ok"
        assert p.engine.rooms == {}  # type: ignore[attr-defined]


async def test_openai_route_and_other_prompt(session: aiohttp.ClientSession) -> None:
    async with (
        run_stub(engine="sglang", role="prefill") as p,
        run_stub(engine="sglang", role="decode") as d,
    ):
        boot = {
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": p.bootstrap_port,
            "bootstrap_room": 7,
        }
        pre = post(session, p.url + "/v1/completions", completion("same", **boot))
        dec = post(session, d.url + "/v1/completions", completion("different", **boot))
        (ps, _), (ds, out) = await asyncio.gather(pre, dec)
        assert ps == 200 and ds == 200
        assert is_local_text(out["choices"][0]["text"])
        assert (await d.recorder.next_decision()).reason == "prompt_mismatch"

        boot["bootstrap_room"] = 8
        pre = asyncio.create_task(
            post(
                session,
                p.url + "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "x"}], **boot},
            )
        )
        dec_body = {"messages": [{"role": "user", "content": "x"}], "stream": True, **boot}
        async with session.post(d.url + "/v1/chat/completions", json=dec_body) as resp:
            events = sse_events(await resp.text())
        await pre
        assert events[-1] == "[DONE]"
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
        assert is_remote_text(text)


async def test_timeouts_on_both_sides(session: aiohttp.ClientSession) -> None:
    async with (
        run_stub(engine="sglang", role="prefill", bootstrap_timeout_s=0.05) as p,
        run_stub(engine="sglang", role="decode", waiting_timeout_s=0.05) as d,
    ):
        status, out = await post(session, p.url + "/generate", generate_body(p, 1))
        assert status == 500
        assert "KVTransferError(bootstrap_room=1)" in out["error"]["message"]
        assert "KVPoll.Bootstrapping" in out["error"]["message"]
        # Wrong room: the decode never meets a prefill.
        status, out = await post(
            session,
            d.url + "/v1/completions",
            completion(
                bootstrap_host="127.0.0.1", bootstrap_port=p.bootstrap_port, bootstrap_room=99
            ),
        )
        assert status == 500 and out["object"] == "error"
        assert "KVPoll.WaitingForInput" in out["message"]
        assert p.engine.rooms == {}  # type: ignore[attr-defined]


async def test_wrong_bootstrap_port_and_missing_fields(session: aiohttp.ClientSession) -> None:
    async with (
        run_stub(engine="sglang", role="decode") as d,
        run_stub(engine="sglang", role="decode") as other,
    ):
        status, out = await post(
            session,
            d.url + "/generate",
            {
                "text": "x",
                "bootstrap_host": "127.0.0.1",
                "bootstrap_port": other.port,
                "bootstrap_room": 3,
            },
        )
        assert status == 500 and "KVTransferError(bootstrap_room=3)" in out["error"]["message"]
        status, out = await post(session, d.url + "/generate", {"text": "x", "bootstrap_room": 3})
        assert status == 200 and is_local_text(out["text"])
        assert (await d.recorder.next_decision()).reason == "missing_params"
        status, out = await post(session, d.url + "/generate", {"text": "x"})
        assert is_local_text(out["text"])
        assert (await d.recorder.next_decision()).reason == "no_handoff"


async def test_prefill_fault_leaves_decode_waiting_until_timeout(
    session: aiohttp.ClientSession,
) -> None:
    async with (
        run_stub(engine="sglang", role="prefill") as p,
        run_stub(engine="sglang", role="decode", waiting_timeout_s=0.2) as d,
    ):
        p.faults.add("status", status=503, times=1)
        body = generate_body(p, 5)
        pre = post(session, p.url + "/generate", body)
        dec = post(session, d.url + "/generate", body)
        (ps, pout), (ds, dout) = await asyncio.gather(pre, dec)
        assert ps == 503 and pout == {"error": {"message": "stub fault"}}
        assert ds == 500 and "timed out after 0.2s" in dout["error"]["message"]


async def test_no_handoff_fault_prefill_answers_without_rendezvous(
    session: aiohttp.ClientSession,
) -> None:
    async with run_stub(engine="sglang", role="prefill") as p:
        p.faults.add("no_handoff", times=1)
        status, out = await post(session, p.url + "/generate", generate_body(p, 6))
        assert status == 200 and len(out["output_ids"]) == 1


@pytest.mark.parametrize("side", ["prefill", "decode"])
async def test_abort_request_ends_a_waiting_request(
    session: aiohttp.ClientSession, side: str
) -> None:
    async with (
        run_stub(engine="sglang", role="prefill") as p,
        run_stub(engine="sglang", role="decode") as d,
    ):
        target = p if side == "prefill" else d
        body = generate_body(p, 11, rid="rid-1")
        task = asyncio.create_task(post(session, target.url + "/generate", body))
        if side == "prefill":
            await p.recorder.next_request("/generate")
            # Recorded before its handler ran up to its first wait: the rid is registered.
            assert "rid-1" in p.engine.aborts  # type: ignore[attr-defined]
        else:
            await p.bootstrap_recorder.next_request("/_stub/sglang/rooms/11")
        async with session.post(target.url + "/abort_request", json={"rid": "rid-1"}) as resp:
            assert resp.status == 200 and await resp.read() == b""
        status, out = await task
        assert status == 200
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert out["output_ids"] == []
        await target.wait_idle()


async def test_generate_stream_shape(session: aiohttp.ClientSession) -> None:
    async with run_stub(engine="sglang", role="decode") as d:
        async with session.post(
            d.url + "/generate",
            json={"input_ids": [5, 6], "stream": True, "sampling_params": {"max_new_tokens": 3}},
        ) as resp:
            events = sse_events(await resp.text())
        assert events[-1] == "[DONE]"
        assert [len(e["output_ids"]) for e in events[:-1]] == [1, 2, 3]
        assert events[2]["text"].startswith(events[1]["text"])
        assert events[2]["meta_info"]["finish_reason"]["type"] == "length"
        assert events[0]["meta_info"]["finish_reason"] is None
        status, out = await post(session, d.url + "/generate", {"sampling_params": {}})
        assert status == 400 and "error" in out
