"""The lean bench engine behaves like the engines it stands in for, on real loopback sockets.

Proves: a vLLM NIXL prefill answers the documented hand-off keys in vLLM 0.32's order; a
decode accepts a hand-off its prefill issued for the same prompt exactly once (remote words,
``remote/ok`` counted in ``/metrics`` as ``bench.run`` reads it) and recomputes locally on a
reused, tampered, foreign, incomplete or unreachable one; SGLang prefill and decode meet by
room in either order, a prompt mismatch is local, and a lone prefill or decode answers 500
when its bounded wait ends; streams are chunked one SSE event per chunk, a token per event
then ``[DONE]``; keep-alive reuses one connection, pipelined requests answer in order, idle
connections close after the keep-alive time; malformed HTTP or JSON answers 400.
Does not prove speed (see bench.run) or anything about chat or ``/generate``.
"""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from protocol_builders import nixl_prefill_skeleton

from bench.lean_client import Client, Origin
from sidecar.tools.stubs import textgen
from sidecar.tools.stubs.lean.server import Engine
from sidecar.tools.stubs.lean.server import run_lean as run_engine

PROMPT = "The quick brown fox jumps over the lazy dog."
NIXL_KEYS = [
    "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
    "remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size",
    "remote_num_tokens", "remote_blocks_expiry_time", "transfer_mode",
    "remote_prefill_cached_tokens",
]


@pytest.fixture
async def client() -> AsyncIterator[Client]:
    c = Client(timeout_s=10.0)
    yield c
    await c.close()


async def post(client: Client, engine: Engine, body: dict[str, Any], **kw: Any) -> Any:
    return await client.request(
        Origin("127.0.0.1", engine.port), "POST", "/v1/completions",
        {"content-type": "application/json"}, orjson.dumps(body), **kw,
    )


def text_of(answer: Any) -> str:
    assert answer.status == 200, answer.body
    return str(orjson.loads(answer.body)["choices"][0]["text"])


async def prefill_params(client: Client, prefill: Engine, prompt: str = PROMPT) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 1, "stream": False,
            "kv_transfer_params": nixl_prefill_skeleton()}
    answer = await post(client, prefill, body)
    params: dict[str, Any] = orjson.loads(answer.body)["kv_transfer_params"]
    return params


def decode_body(params: dict[str, Any], prompt: str = PROMPT, **kw: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": 4, "kv_transfer_params": params, **kw}


async def test_nixl_prefill_answers_the_documented_keys(client: Client) -> None:
    async with run_engine(engine="vllm", role="prefill") as prefill:
        params = await prefill_params(client, prefill)
    assert list(params) == NIXL_KEYS
    assert params["remote_engine_id"] == prefill.engine_id
    assert params["remote_port"] == prefill.port
    assert params["remote_host"] == "localhost"
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_num_tokens"] == len(textgen.encode_text(PROMPT))
    assert params["remote_block_ids"] and all(b > 0 for b in params["remote_block_ids"][0])


async def test_nixl_decode_accepts_its_prefills_handoff_once(client: Client) -> None:
    async with (
        run_engine(engine="vllm", role="prefill") as prefill,
        run_engine(engine="vllm", role="decode") as decode,
    ):
        params = await prefill_params(client, prefill)
        params["remote_host"] = "127.0.0.1"
        first = text_of(await post(client, decode, decode_body(params)))
        again = text_of(await post(client, decode, decode_body(params)))
        metrics = await client.request(Origin("127.0.0.1", decode.port), "GET", "/metrics")
    assert first == textgen.expected_text(textgen.encode_text(PROMPT), 4)
    assert textgen.is_local_text(again)
    assert dict(decode.verdicts) == {("remote", "ok"): 1, ("local", "unknown_request"): 1}
    assert b'stub_handoff_total{outcome="remote",reason="ok"} 1' in metrics.body


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_nixl_decode_recomputes_on_a_bad_handoff(client: Client) -> None:
    async with (
        run_engine(engine="vllm", role="prefill") as prefill,
        run_engine(engine="vllm", role="decode") as decode,
    ):
        cases: list[tuple[str, dict[str, Any], str]] = []
        for reason, change, prompt in (
            ("block_mismatch", {"remote_block_ids": [[999999]]}, PROMPT),
            ("engine_mismatch", {"remote_engine_id": "someone-else"}, PROMPT),
            ("block_mismatch", {}, PROMPT + " (another prompt)"),
            ("missing_params", {"remote_request_id": None}, PROMPT),
            ("pull_failed", {"remote_port": _closed_port()}, PROMPT),
        ):
            params = {**await prefill_params(client, prefill), "remote_host": "127.0.0.1"}
            cases.append((reason, {**params, **change}, prompt))
        for _, params, prompt in cases:
            assert textgen.is_local_text(text_of(await post(client, decode,
                                                            decode_body(params, prompt))))
        plain = text_of(await post(client, decode, {"prompt": PROMPT, "max_tokens": 2}))
    assert textgen.is_local_text(plain)
    assert dict(decode.verdicts) == {
        ("local", "block_mismatch"): 2, ("local", "engine_mismatch"): 1,
        ("local", "missing_params"): 1, ("local", "pull_failed"): 1,
        ("local", "no_handoff"): 1,
    }


def sglang_body(port: int, room: int, prompt: str = PROMPT, **kw: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": 3, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": port, "bootstrap_room": room, **kw}


async def until(predicate: Any) -> None:
    """Let the loop run until ``predicate()`` holds (bounded in steps, not in time)."""
    for _ in range(10_000):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


@pytest.mark.parametrize("first", ["prefill", "decode"])
async def test_sglang_rendezvous_in_either_order(client: Client, first: str) -> None:
    async with (
        run_engine(engine="sglang", role="prefill") as prefill,
        run_engine(engine="sglang", role="decode") as decode,
    ):
        assert prefill.bootstrap_port
        body = sglang_body(prefill.bootstrap_port, 7)
        board = prefill.flavour.board  # type: ignore[attr-defined]
        if first == "prefill":
            p = asyncio.ensure_future(post(client, prefill, body))
            await until(lambda: 7 in board.prefills)
            d = asyncio.ensure_future(post(client, decode, body))
        else:
            d = asyncio.ensure_future(post(client, decode, body))
            await until(lambda: 7 in board.decodes)
            p = asyncio.ensure_future(post(client, prefill, body))
        p_answer, d_answer = await asyncio.gather(p, d)
    expected = textgen.expected_text(textgen.encode_text(PROMPT), 3)
    assert text_of(d_answer) == expected
    assert text_of(p_answer) == textgen.expected_text(textgen.encode_text(PROMPT), 1)
    assert dict(decode.verdicts) == {("remote", "ok"): 1}
    assert not board.prefills and not board.decodes


async def test_sglang_prompt_mismatch_is_local(client: Client) -> None:
    async with (
        run_engine(engine="sglang", role="prefill") as prefill,
        run_engine(engine="sglang", role="decode") as decode,
    ):
        assert prefill.bootstrap_port
        answers = await asyncio.gather(
            post(client, prefill, sglang_body(prefill.bootstrap_port, 9)),
            post(client, decode, sglang_body(prefill.bootstrap_port, 9, PROMPT + "!")),
        )
        missing = await post(client, decode, {"prompt": PROMPT, "bootstrap_room": 3})
    assert answers[0].status == 200
    assert textgen.is_local_text(text_of(answers[1]))
    assert textgen.is_local_text(text_of(missing))
    assert dict(decode.verdicts) == {
        ("local", "prompt_mismatch"): 1, ("local", "missing_params"): 1
    }


async def test_sglang_waits_are_bounded(client: Client) -> None:
    async with (
        run_engine(engine="sglang", role="prefill", bootstrap_timeout_s=0.05) as prefill,
        run_engine(engine="sglang", role="decode", waiting_timeout_s=0.05) as decode,
    ):
        assert prefill.bootstrap_port
        lone_prefill = await post(client, prefill, sglang_body(prefill.bootstrap_port, 1))
        lone_decode = await post(client, decode, sglang_body(prefill.bootstrap_port, 2))
        unreachable = await post(client, decode, sglang_body(_closed_port(), 3))
    assert lone_prefill.status == 500
    assert b"timed out after 0.05s in KVPoll.Bootstrapping" in lone_prefill.body
    assert lone_decode.status == 500
    assert b"timed out after 0.05s in KVPoll.WaitingForInput" in lone_decode.body
    assert unreachable.status == 500 and b"Failed to fetch bootstrap info" in unreachable.body
    assert not prefill.flavour.board.decodes  # type: ignore[attr-defined]
    assert not prefill.flavour.board.prefills  # type: ignore[attr-defined]


async def raw_exchange(port: int, data: bytes) -> bytes:
    """Send ``data``, read until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


def dechunk(raw: bytes) -> list[bytes]:
    """The chunks of a chunked body that follows the head."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    chunks: list[bytes] = []
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return chunks
        chunks.append(rest[:size])
        assert rest[size:size + 2] == b"\r\n"
        rest = rest[size + 2:]


def request(body: dict[str, Any], *, close: bool = True) -> bytes:
    data = orjson.dumps(body)
    return (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + (b"connection: close\r\n" if close else b"")
            + b"content-length: %d\r\n\r\n" % len(data) + data)


async def test_stream_is_one_event_per_chunk_then_done() -> None:
    async with run_engine(engine="vllm", role="decode") as decode:
        raw = await raw_exchange(decode.port, request(
            {"prompt": PROMPT, "max_tokens": 5, "stream": True}
        ))
    assert raw.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"content-type: text/event-stream" in raw
    chunks = dechunk(raw)
    assert len(chunks) == 6 and chunks[-1] == b"data: [DONE]\n\n"
    events = [orjson.loads(c.removeprefix(b"data: ")) for c in chunks[:-1]]
    assert all(c.startswith(b"data: ") and c.endswith(b"\n\n") for c in chunks)
    assert [e["choices"][0]["finish_reason"] for e in events] == [None] * 4 + ["length"]
    text = "".join(e["choices"][0]["text"] for e in events)
    assert text == textgen.expected_text(textgen.encode_text(PROMPT), 5, textgen.PrefillKind.LOCAL)


async def test_keep_alive_reuses_one_connection(client: Client) -> None:
    async with run_engine(engine="vllm", role="decode") as decode:
        for stream in (False, True, False):
            answer = await post(client, decode, {"prompt": PROMPT, "max_tokens": 2,
                                                 "stream": stream}, count_events=stream)
            assert answer.status == 200
    assert decode.server.accepted == 1


async def test_pipelined_requests_answer_in_order() -> None:
    async with run_engine(engine="vllm", role="decode") as decode:
        raw = await raw_exchange(
            decode.port,
            request({"prompt": "a", "max_tokens": 1}, close=False)
            + b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
            + b"GET /nowhere HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        )
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", raw)
    assert statuses == [b"200", b"200", b"404"]
    assert raw.index(b'"text"') < raw.index(b"HTTP/1.1 404")


async def test_idle_connection_closes_after_keep_alive() -> None:
    async with run_engine(engine="vllm", role="decode", keepalive_s=0.05) as decode:
        raw = await raw_exchange(decode.port, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"connection: close" not in raw  # closed by the idle sweep, not per request


@pytest.mark.parametrize("data", [
    b"GARBAGE\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\ncontent-length: nope\r\n\r\n",
])
async def test_malformed_http_is_400_and_closed(data: bytes) -> None:
    async with run_engine(engine="vllm", role="decode") as decode:
        raw = await raw_exchange(decode.port, data)
    assert raw.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert b"connection: close" in raw


async def test_oversized_body_is_413() -> None:
    async with run_engine(engine="vllm", role="decode") as decode:
        decode.server.max_body = 10
        raw = await raw_exchange(decode.port, request({"prompt": PROMPT}))
    assert raw.startswith(b"HTTP/1.1 413 ")


async def test_bad_bodies_are_400_in_the_engines_words(client: Client) -> None:
    async with (
        run_engine(engine="vllm", role="decode") as vllm,
        run_engine(engine="sglang", role="decode") as sglang,
    ):
        origin = Origin("127.0.0.1", vllm.port)
        not_json = await client.request(origin, "POST", "/v1/completions", {}, b"{nope")
        no_prompt = await post(client, vllm, {"max_tokens": 2})
        bad_room = await post(client, sglang, {"prompt": PROMPT, "bootstrap_room": "x"})
        models = await client.request(origin, "GET", "/v1/models")
        health = await client.request(origin, "GET", "/health")
    assert not_json.status == 400
    assert orjson.loads(not_json.body)["error"]["type"] == "BadRequestError"
    assert no_prompt.status == 400
    assert bad_room.status == 400 and orjson.loads(bad_room.body)["object"] == "error"
    assert orjson.loads(models.body)["data"][0]["id"] == "stub-model"
    assert health.status == 200 and health.body == b""
