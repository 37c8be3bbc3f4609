"""Proves the NIXL push flow through the HTTP front door, on stub engines
(docs/driving/nixl-push.md).

A vLLM stub pair with the ``nixl-push`` connector (the decode "registers" at the prefill and
waits for its KV, either order) behind the real sidecar: the first request to a target runs
its legs one after the other and learns the prefill's identity; later ones send the decode
while the prefill still runs (a delayed prefill: the decode is seen before it answers); both
legs carry the same X-Request-Id; concurrent first requests learn once; a prefill engine
"restarted" under a new engine id fails nothing, JSON or streamed (the refused decode, a 500
head or a first error event, goes again from the prefill's answer) and is learned; a failed
concurrent prefill fails the request with the prefill's error; an operator-given identity
makes the first request concurrent.

Does not prove: real vLLM (tests/real_vllm/test_nixl_push.py), the gRPC door
(tests/grpc_server/test_nixl_push_grpc.py).
"""

from __future__ import annotations

import asyncio
import json

from pd_builders import PDPair, pd_pair, streamed_text
from sidecar_builders import decode_sidecar_settings, running_sidecar, stub_pair

from sidecar.protocol.context import Route
from sidecar.tools.stubs.server import Stub
from sidecar.tools.stubs.textgen import is_remote_text

PREFILL_DELAY_S = 3.0


def prefilled(stub: Stub) -> int:
    """How many prefills the stub engine has finished (its push connector's count)."""
    return int(getattr(stub.engine, "connector").pushed)  # noqa: B009 - the vLLM flavour's


def text_of(body: str) -> str:
    return str(json.loads(body)["choices"][0]["text"])


async def run_ok(pair: PDPair, **kwargs: object) -> str:
    status, _, body = await pair.send(**kwargs)  # type: ignore[arg-type]
    assert status == 200, body
    return body


async def test_first_request_learns_then_both_legs_go_at_once() -> None:
    async with pd_pair("vllm", "nixl-push") as pair:
        pair.prefill.faults.add("delay", path="/v1/completions", delay_s=1.0, times=1)
        first = asyncio.ensure_future(run_ok(pair))
        decode_seen = await pair.decode.recorder.next_request("/v1/completions")
        # Learned from the answer: the decode went once the prefill had answered.
        assert prefilled(pair.prefill) == 1
        prefill_seen = await pair.prefill.recorder.next_request("/v1/completions")
        assert is_remote_text(text_of(await first))
        assert prefill_seen.headers["X-Request-Id"] == decode_seen.headers["X-Request-Id"]

        pair.prefill.faults.add("delay", path="/v1/completions", delay_s=PREFILL_DELAY_S,
                                times=1)
        answered = prefilled(pair.prefill)
        second = asyncio.ensure_future(run_ok(pair, stream=True))
        decode_seen = await pair.decode.recorder.next_request("/v1/completions")
        # The decode reached its engine before the prefill answered.
        assert prefilled(pair.prefill) == answered
        prefill_seen = await pair.prefill.recorder.next_request("/v1/completions")
        assert prefill_seen.headers["X-Request-Id"] == decode_seen.headers["X-Request-Id"]
        await second
        decision = [d for d in pair.decode.recorder.decisions if d.outcome == "remote"]
        assert len(decision) == 2


async def test_concurrent_first_requests_learn_the_target_once() -> None:
    async with pd_pair("vllm", "nixl-push") as pair:
        pair.prefill.faults.add("delay", path="/v1/completions", delay_s=1.0, times=1)
        bodies = await asyncio.gather(*(run_ok(pair) for _ in range(4)))
        assert all(is_remote_text(text_of(body)) for body in bodies)
        assert len(pair.prefill.recorder.on_path("/v1/completions")) == 4
        assert [d.reason for d in pair.decode.recorder.decisions] == ["ok"] * 4


async def test_a_restarted_prefill_engine_is_learned_again_without_a_failed_request() -> None:
    async with pd_pair("vllm", "nixl-push") as pair:
        await run_ok(pair)  # learns
        pair.prefill.engine_id = "restarted-under-a-new-id"
        # The decode knew the old id, so it waits on it (as vLLM does, for minutes); the
        # prefill's answer shows the new one: that decode is stopped and sent again from it.
        again = await run_ok(pair)
        assert is_remote_text(text_of(again))
        assert len(pair.prefill.recorder.on_path("/v1/completions")) == 2
        assert len(pair.decode.recorder.on_path("/v1/completions")) == 3
        # Learned: the next one goes at once with the new identity.
        await run_ok(pair, stream=True)
        last = pair.decode.recorder.on_path("/v1/completions")[-1].json
        assert last["kv_transfer_params"]["remote_engine_id"] == "restarted-under-a-new-id"
        assert len(pair.prefill.recorder.on_path("/v1/completions")) == 3


async def test_a_refused_stream_is_sent_again_before_its_first_byte() -> None:
    async with stub_pair("vllm", "nixl-push") as (prefill, decode):
        # An identity the decode never registered with: refused at once (vLLM: "Remote NIXL
        # agent engine ID mismatch").
        settings = decode_sidecar_settings(
            "vllm", "nixl-push", prefill, decode, nixl_push_engine_id="operator-typo",
            nixl_push_side_channel_port=prefill.port)
        async with running_sidecar(**settings) as sidecar:
            await _refused_stream_sent_again(PDPair("vllm", "nixl-push", prefill, decode,
                                                    sidecar))


async def _refused_stream_sent_again(pair: PDPair) -> None:
    # vLLM fails a stream after its 200 head: an error event first. The sidecar reads that
    # first event before its own head leaves, and sends the decode again.
    status, _, body = await pair.send(stream=True)
    assert status == 200, body
    assert is_remote_text(streamed_text(body)) and '"error"' not in body
    decodes = pair.decode.recorder.on_path("/v1/completions")
    assert len(decodes) == 2 and len(pair.prefill.recorder.on_path("/v1/completions")) == 1
    assert decodes[-1].json["kv_transfer_params"]["remote_engine_id"] == (
        pair.prefill.engine_id)


async def test_a_failed_concurrent_prefill_fails_the_request() -> None:
    async with pd_pair("vllm", "nixl-push") as pair:
        await run_ok(pair)
        pair.prefill.faults.add("status", path="/v1/completions", status=500, times=1)
        status, _, body = await pair.send()
        assert status == 502, body
        assert json.loads(body)["error"]["code"] == "prefill_failed"
        await run_ok(pair)  # the identity stayed: a 500 says nothing about it


async def test_an_operator_given_identity_makes_the_first_request_concurrent() -> None:
    async with stub_pair("vllm", "nixl-push") as (prefill, decode):
        prefill.engine_id = "op-given"
        settings = decode_sidecar_settings(
            "vllm", "nixl-push", prefill, decode, nixl_push_engine_id="op-given",
            nixl_push_side_channel_port=prefill.port)
        async with running_sidecar(**settings) as sidecar:
            pair = PDPair("vllm", "nixl-push", prefill, decode, sidecar)
            prefill.faults.add("delay", path="/v1/chat/completions", delay_s=PREFILL_DELAY_S,
                               times=1)
            first = asyncio.ensure_future(run_ok(pair, route=Route.CHAT))
            decode_seen = await decode.recorder.next_request("/v1/chat/completions")
            assert prefilled(prefill) == 0  # the very first request: both at once
            assert decode_seen.json["kv_transfer_params"]["remote_engine_id"] == "op-given"
            await first
            assert [d.reason for d in decode.recorder.decisions] == ["ok"]


async def test_a_decode_refusal_the_prefill_answer_does_not_explain_is_relayed() -> None:
    async with pd_pair("vllm", "nixl-push") as pair:
        await run_ok(pair)
        pair.decode.faults.add("status", path="/v1/completions", status=500, times=1)
        status, _, body = await pair.send()
        assert status == 502, body
        assert json.loads(body)["error"]["code"] == "decode_failed"
        # Sent once: the identity the prefill's answer showed was the one the decode had.
        assert len(pair.decode.recorder.on_path("/v1/completions")) == 2
        await run_ok(pair, stream=True)


async def test_a_decode_refusal_no_identity_explains_ends_the_request_at_once() -> None:
    # A decode engine that fails (500, not the engine's "the request failed" of a KV load)
    # while the prefill still runs: the request fails at once, its prefill leg cancelled
    # (its KV released), without waiting for the prefill's answer.
    async with pd_pair("vllm", "nixl-push") as pair:
        await run_ok(pair)
        answered = prefilled(pair.prefill)
        pair.prefill.faults.add("delay", path="/v1/completions", delay_s=PREFILL_DELAY_S,
                                times=1)
        pair.decode.faults.add("status", path="/v1/completions", status=500, times=1)
        status, _, body = await pair.send()
        assert status == 502, body
        assert json.loads(body)["error"]["code"] == "decode_failed"
        assert prefilled(pair.prefill) == answered  # the held prefill never answered
        await run_ok(pair)  # the identity stayed
