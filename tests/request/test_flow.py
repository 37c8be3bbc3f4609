"""Proves ``Runner.start`` (sidecar/request/runner.py), the PD flow of the HTTP door and of each
fan-out sub-request, on real dialects (fixed ids) over fake engine calls (no sockets):

- sequential (TensorRT-LLM, vLLM NIXL): the prefill leg gets the dialect's prefill body, URL,
  headers and deadline; the decode gets the client's body plus the hand-off; the stage
  timings are set; closing a completed exchange ends the dialect state and aborts nothing,
  closing an unfinished one aborts; a failed prefill or decode, or a cancelled caller, ends
  the state and posts the abort;
- concurrent (SGLang): the decode opens while the prefill is still pending, both with the
  same bootstrap fields; a prefill that fails first cancels the pending decode and raises
  the prefill's own error (a crash as ``PrefillFailed``), the room is released and the abort
  posted; a cancelled caller cancels both;
- one retry of a refused connect, on another candidate chosen by the target choice (a
  cooling one skipped), with a new context; none for a prefill that may have reached its
  engine, none with one candidate, never a second;
- ``--on-prefill-failure local``: a failed prefill of a sequential dialect runs the client's
  body on the local engine, counted with its reason; not for a client's bad request, not for
  a concurrent dialect, and only after the retry;
- a prefill that already is the answer (TensorRT-LLM) is returned without a decode;
- a short prompt runs whole on the local engine: no prefill, no dialect state.

It does not prove the engine calls themselves (URLs on the wire, error mapping: the HTTP
suites over stubs do) nor the relay of the exchange's bytes (tests/core/test_exchange.py).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from flow_builders import (
    TARGET_A,
    TARGET_B,
    TARGET_C,
    TEST_ABORT_PATH,
    FakeCalls,
    FakeUpstream,
    counted,
    flow_of,
    pd_request,
    recording,
)
from protocol_builders import FIXED_NOW_MS, completions_body, make_dialect

from sidecar.config.limits import PrefillFailurePolicy
from sidecar.dialects.sglang import SGLangDialect
from sidecar.dialects.trtllm import TRTLLMDialect, snowflake_id
from sidecar.dialects.vllm_nixl import NixlPullDialect
from sidecar.errors import (
    DeadlineExceeded,
    DecodeFailed,
    EngineRejected,
    InvalidHandoff,
    PrefillFailed,
    PrefillUnreachable,
)
from sidecar.request.placement import Decision, Fate
from sidecar.targets.choice import TargetChoice

FIRST_ID = snowflake_id(FIXED_NOW_MS, 0, 0)
SECOND_ID = snowflake_id(FIXED_NOW_MS, 0, 1)
LEFT = PrefillFailurePolicy.LOCAL

#: The prefill body of ``completions_body()`` under the common rules.
PREFILL_BASE: dict[str, Any] = {
    "model": "m", "prompt": "hello world", "max_tokens": 1, "stream": False, "temperature": 0.0,
}


def trt_context(disagg_id: int = FIRST_ID, finish_reason: str = "length") -> dict[str, Any]:
    """A TensorRT-LLM context answer (params in choices[0], token ids at the top level)."""
    return {
        "id": "cmpl-ctx",
        "choices": [{"index": 0, "text": "", "finish_reason": finish_reason,
                     "disaggregated_params": {"request_type": "context_only",
                                              "disagg_request_id": disagg_id,
                                              "ctx_request_id": 9}}],
        "prompt_token_ids": [1, 2, 3],
    }


def trt_generation(disagg_id: int = FIRST_ID) -> dict[str, Any]:
    return {"disaggregated_params": {"request_type": "generation_only",
                                     "disagg_request_id": disagg_id, "ctx_request_id": 9},
            "prompt": [1, 2, 3]}


NIXL_PARAMS: dict[str, Any] = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [4, 5],
    "remote_engine_id": "engine-p", "remote_request_id": "p-1", "remote_host": "localhost",
    "remote_port": 5600, "tp_size": 1,
}


def trt_flow(calls: FakeCalls, **options: Any) -> tuple[Any, Any]:
    dialect = make_dialect(recording(TRTLLMDialect, abort_call=True))
    return dialect, flow_of(dialect, calls, **options)


def sglang_flow(calls: FakeCalls, **options: Any) -> tuple[SGLangDialect, Any]:
    dialect = make_dialect(SGLangDialect, sglang_bootstrap_port=9001)
    return dialect, flow_of(dialect, calls, **options)


def bootstrap(room: int, host: str = TARGET_A.host) -> dict[str, Any]:
    return {"bootstrap_host": host, "bootstrap_port": 9001, "bootstrap_room": room,
            "rid": f"rq-1-{room}"}


# -- sequential ------------------------------------------------------------------------------


async def test_sequential_prefill_then_decode_with_the_hand_off() -> None:
    calls = FakeCalls()
    dialect, flow = trt_flow(calls)
    decode = FakeUpstream(b"data: one\n\n", b"")
    calls.prefill_answers(trt_context())
    calls.decode_answers(decode)
    client = completions_body()

    exchange = await flow.run(pd_request(client))

    (leg,) = calls.prefills
    assert leg.url == "http://10.0.0.1:8100/v1/completions"
    assert leg.body == {**PREFILL_BASE, "disaggregated_params": {
        "request_type": "context_only", "disagg_request_id": FIRST_ID}}
    assert leg.headers == {"X-Request-Id": "rq-1"}
    assert leg.timeout_s == 30.0
    assert leg.target == TARGET_A
    (call,) = calls.decodes
    assert call.body == {**client, **trt_generation()}
    assert call.headers == {"X-Request-Id": "rq-1"}
    assert exchange.ctx.state == FIRST_ID
    timings = exchange.timings
    assert timings.prefill is not None and timings.prefill >= 0
    assert timings.handoff is not None and timings.handoff >= 0
    assert timings.decode_first_byte is not None and timings.decode_first_byte >= 0
    assert exchange.fallback_reason is None and not exchange.local

    assert await exchange.read_all(1024) == b"data: one\n\n"
    assert dialect.ended == []  # the state lives as long as the exchange
    await exchange.aclose()
    assert dialect.ended == [exchange.ctx]
    assert calls.aborts == []  # completed: nothing left to abort
    assert decode.closed


async def test_closing_an_unfinished_sequential_exchange_aborts_the_legs() -> None:
    calls = FakeCalls()
    dialect, flow = trt_flow(calls)
    calls.prefill_answers(trt_context())
    calls.decode_answers(FakeUpstream(b"data: one\n\n"))
    exchange = await flow.run(pd_request(completions_body()))
    await exchange.aclose()
    assert calls.aborts == [(TEST_ABORT_PATH, {"request_id": "rq-1"}, TARGET_A)]
    assert dialect.ended == [exchange.ctx]


async def test_nixl_decode_reads_the_blocks_from_the_prefill_host() -> None:
    calls = FakeCalls()
    flow = flow_of(make_dialect(NixlPullDialect), calls)
    calls.prefill_answers({"choices": [], "kv_transfer_params": NIXL_PARAMS})
    calls.decode_answers(FakeUpstream(b""))
    client = completions_body()
    await flow.run(pd_request(client))
    assert calls.prefills[0].body["kv_transfer_params"]["do_remote_decode"] is True
    assert calls.decodes[0].body == {
        **client, "kv_transfer_params": {**NIXL_PARAMS, "remote_host": TARGET_A.host}}


@pytest.mark.parametrize("error", [PrefillFailed("prefill engine answered 500"),
                                   InvalidHandoff("no params"), EngineRejected("bad")],
                         ids=["failed", "invalid_handoff", "rejected"])
async def test_a_failed_prefill_raises_ends_the_state_and_aborts(error: Exception) -> None:
    calls = FakeCalls()
    dialect, flow = trt_flow(calls)
    calls.prefill_answers(error)
    with pytest.raises(type(error)) as raised:
        await flow.run(pd_request(completions_body()))
    assert raised.value is error
    assert calls.decodes == []
    assert dialect.ended == dialect.begun and len(dialect.begun) == 1
    assert calls.aborts == [(TEST_ABORT_PATH, {"request_id": "rq-1"}, TARGET_A)]


async def test_an_unusable_hand_off_is_the_requests_error() -> None:
    calls = FakeCalls()
    flow = flow_of(make_dialect(NixlPullDialect), calls)
    calls.prefill_answers({"choices": []})  # no kv_transfer_params
    with pytest.raises(InvalidHandoff):
        await flow.run(pd_request(completions_body()))
    assert calls.decodes == []


async def test_a_failed_decode_open_ends_the_state_and_aborts() -> None:
    calls = FakeCalls()
    dialect, flow = trt_flow(calls)
    calls.prefill_answers(trt_context())
    calls.decode_answers(DecodeFailed("decode engine answered 500"))
    with pytest.raises(DecodeFailed):
        await flow.run(pd_request(completions_body()))
    assert len(dialect.ended) == 1
    assert len(calls.aborts) == 1


async def test_a_caller_cancelled_during_the_prefill_ends_the_state_and_aborts() -> None:
    calls = FakeCalls()
    dialect, flow = trt_flow(calls)
    calls.hold_prefill()
    task = asyncio.ensure_future(flow.run(pd_request(completions_body())))
    await calls.until(prefills=1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert calls.cancelled == ["prefill"]
    assert calls.decodes == []
    assert len(dialect.ended) == 1
    assert len(calls.aborts) == 1


async def test_a_prefill_that_is_the_answer_needs_no_decode() -> None:
    calls = FakeCalls()
    dialect, flow = trt_flow(calls)
    calls.prefill_answers(trt_context(finish_reason="stop"))
    exchange = await flow.run(pd_request(completions_body()))
    assert exchange.decode is None
    assert exchange.answer == {
        "id": "cmpl-ctx", "prompt_token_ids": [1, 2, 3],
        "choices": [{"index": 0, "text": "", "finish_reason": "stop"}],
    }
    assert calls.decodes == []
    assert exchange.timings.prefill is not None and exchange.timings.handoff is None
    await exchange.aclose()
    assert dialect.ended == [exchange.ctx]
    assert calls.aborts == []  # no decode ran: nothing to abort


# -- concurrent ------------------------------------------------------------------------------


async def test_concurrent_decode_opens_while_the_prefill_is_pending() -> None:
    calls = FakeCalls()
    dialect, flow = sglang_flow(calls)
    held = calls.hold_prefill()
    decode = FakeUpstream()
    calls.decode_answers(decode)
    client = completions_body()

    exchange = await flow.run(pd_request(client))

    assert not held.done() and exchange.prefill_task is not None
    room = exchange.ctx.state
    assert isinstance(room, int) and dialect.rooms.in_flight() == 1
    assert calls.prefills[0].body == {**PREFILL_BASE, **bootstrap(room)}
    assert calls.decodes[0].body == {**client, **bootstrap(room)}
    assert exchange.timings.decode_first_byte is not None
    assert exchange.timings.prefill is None  # still running when the decode head came

    held.set_result({"choices": []})
    await exchange.prefill_task
    decode.feed(b"data: a\n\n")
    decode.feed(b"")
    assert await exchange.read_all(1024) == b"data: a\n\n"
    await exchange.aclose()
    assert dialect.rooms.in_flight() == 0
    assert calls.aborts == []
    assert calls.cancelled == []


async def test_a_concurrent_prefill_that_answers_first_is_timed() -> None:
    calls = FakeCalls()
    dialect, flow = sglang_flow(calls)
    calls.prefill_answers({"choices": []})
    held = calls.hold_decode()
    task = asyncio.ensure_future(flow.run(pd_request(completions_body())))
    await calls.until(prefills=1, decodes=1)
    held.set_result(FakeUpstream(b""))
    exchange = await task
    assert exchange.prefill_task is not None and exchange.prefill_task.done()
    assert exchange.timings.prefill is not None
    assert await exchange.read_all(10) == b""
    await exchange.aclose()
    assert dialect.rooms.in_flight() == 0 and calls.aborts == []


@pytest.mark.parametrize(("raised", "expected"), [
    (PrefillFailed("prefill engine answered 503"), PrefillFailed),
    (RuntimeError("boom"), PrefillFailed),
    (DeadlineExceeded("prefill timed out"), DeadlineExceeded),
], ids=["prefill_failed", "crash", "deadline"])
async def test_a_failed_concurrent_prefill_cancels_the_decode_and_raises_its_error(
    raised: Exception, expected: type[Exception]
) -> None:
    calls = FakeCalls()
    dialect, flow = sglang_flow(calls)
    calls.prefill_answers(raised)
    calls.hold_decode()
    with pytest.raises(expected) as error:
        await flow.run(pd_request(completions_body()))
    if isinstance(raised, expected):
        assert error.value is raised
    else:
        assert error.value.args == ("prefill leg failed unexpectedly",)  # never a class name
    assert calls.cancelled == ["decode"]
    room = calls.prefills[0].body["bootstrap_room"]
    assert dialect.rooms.in_flight() == 0
    assert calls.aborts == [("/abort_request", {"rid": f"rq-1-{room}"}, TARGET_A)]


async def test_a_decode_head_that_arrives_with_the_prefill_failure_is_closed() -> None:
    calls = FakeCalls()
    _, flow = sglang_flow(calls)
    decode = FakeUpstream()
    calls.prefill_answers(PrefillFailed("prefill engine answered 503"))
    calls.decode_answers(decode)  # both finish before the flow looks again
    with pytest.raises(PrefillFailed):
        await flow.run(pd_request(completions_body()))
    assert decode.closed or decode.released


async def test_a_concurrent_prefill_failing_after_the_decode_head_breaks_the_stream() -> None:
    calls = FakeCalls()
    dialect, flow = sglang_flow(calls)
    held = calls.hold_prefill()
    decode = FakeUpstream(b"data: a\n\n")
    calls.decode_answers(decode)
    exchange = await flow.run(pd_request(completions_body()))
    chunks = exchange.chunks()
    assert await anext(chunks) == b"data: a\n\n"
    failure = PrefillFailed("prefill engine answered 503")
    held.set_exception(failure)
    with pytest.raises(PrefillFailed) as raised:
        async with asyncio.timeout(5):  # only the prefill watch ends this read
            await anext(chunks)
    assert raised.value is failure
    assert decode.closed
    await exchange.aclose()
    assert dialect.rooms.in_flight() == 0
    assert len(calls.aborts) == 1


async def test_a_caller_cancelled_during_a_concurrent_start_cancels_both_legs() -> None:
    calls = FakeCalls()
    dialect, flow = sglang_flow(calls)
    calls.hold_prefill()
    calls.hold_decode()
    task = asyncio.ensure_future(flow.run(pd_request(completions_body())))
    await calls.until(prefills=1, decodes=1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(calls.cancelled) == ["decode", "prefill"]
    assert dialect.rooms.in_flight() == 0
    assert [path for path, _, _ in calls.aborts] == ["/abort_request"]


# -- one retry of a refused connect ------------------------------------------------------------


async def test_a_refused_prefill_moves_once_to_another_candidate() -> None:
    calls = FakeCalls()
    counts = counted()
    dialect, flow = trt_flow(calls, counts=counts)
    calls.prefill_answers(PrefillUnreachable("refused"), trt_context(SECOND_ID))
    calls.decode_answers(FakeUpstream(b""))
    client = completions_body()
    exchange = await flow.run(pd_request(client, candidates=(TARGET_A, TARGET_B)))
    assert [leg.url for leg in calls.prefills] == [
        "http://10.0.0.1:8100/v1/completions", "http://10.0.0.2:8100/v1/completions"]
    assert [leg.target for leg in calls.prefills] == [TARGET_A, TARGET_B]
    # A new context: a new id on the second leg, the first one's state given back.
    assert [ctx.state for ctx in dialect.begun] == [FIRST_ID, SECOND_ID]
    assert dialect.ended == [dialect.begun[0]]
    assert exchange.ctx.prefill == TARGET_B
    assert calls.decodes[0].body == {**client, **trt_generation(SECOND_ID)}
    assert counts.retries == ["http"]


async def test_a_concurrent_retry_aborts_the_decode_already_sent() -> None:
    calls = FakeCalls()
    counts = counted()
    dialect, flow = sglang_flow(calls, counts=counts)
    calls.prefill_answers(PrefillUnreachable("refused"))
    calls.hold_decode()
    calls.hold_prefill()
    calls.decode_answers(FakeUpstream())
    exchange = await flow.run(pd_request(completions_body(), candidates=(TARGET_A, TARGET_B)))
    first_room = calls.prefills[0].body["bootstrap_room"]
    assert calls.cancelled == ["decode"]
    assert calls.aborts == [("/abort_request", {"rid": f"rq-1-{first_room}"}, TARGET_A)]
    assert calls.prefills[1].body["bootstrap_host"] == TARGET_B.host
    assert calls.decodes[1].body["bootstrap_room"] == exchange.ctx.state != first_room
    assert dialect.rooms.in_flight() == 1
    assert counts.retries == ["http"]
    await exchange.aclose()


async def test_the_retry_target_is_picked_again_after_the_first_try() -> None:
    # B starts cooling while the first prefill runs (another request saw it refuse): the
    # retry goes to C, whatever was picked before the first try.
    for seed in range(8):
        choice = TargetChoice(cooldown_s=60, clock=lambda: 100.0, rng=random.Random(seed))
        calls = FakeCalls(choice=choice)
        _, flow = trt_flow(calls)
        held = calls.hold_prefill()
        calls.prefill_answers(trt_context())
        calls.decode_answers(FakeUpstream(b""))
        task = asyncio.ensure_future(flow.run(pd_request(
            completions_body(), candidates=(TARGET_A, TARGET_B, TARGET_C))))
        await calls.until(prefills=1)
        choice.refused(TARGET_B)
        held.set_exception(PrefillUnreachable("refused"))
        await task
        assert calls.prefills[1].target == TARGET_C, seed


@pytest.mark.parametrize(("error", "candidates"), [
    (PrefillFailed("cut after the request was sent"), (TARGET_A, TARGET_B)),
    (DeadlineExceeded("prefill timed out"), (TARGET_A, TARGET_B)),
    (PrefillUnreachable("refused"), (TARGET_A,)),
    (PrefillUnreachable("refused"), ()),
    (PrefillUnreachable("refused"), (TARGET_A, TARGET_A)),
], ids=["may_have_run", "deadline", "one_candidate", "no_candidates", "same_candidate"])
async def test_no_retry(error: Exception, candidates: tuple[Any, ...]) -> None:
    calls = FakeCalls()
    counts = counted()
    _, flow = trt_flow(calls, counts=counts)
    calls.prefill_answers(error)
    with pytest.raises(type(error)):
        await flow.run(pd_request(completions_body(), candidates=candidates))
    assert len(calls.prefills) == 1
    assert counts.retries == []


async def test_a_second_refusal_is_not_retried() -> None:
    calls = FakeCalls()
    counts = counted()
    dialect, flow = trt_flow(calls, counts=counts)
    calls.prefill_answers(PrefillUnreachable("refused"), PrefillUnreachable("refused too"))
    with pytest.raises(PrefillUnreachable):
        await flow.run(pd_request(completions_body(),
                                    candidates=(TARGET_A, TARGET_B, TARGET_C)))
    assert len(calls.prefills) == 2
    assert counts.retries == ["http"]
    assert dialect.ended == dialect.begun and len(dialect.begun) == 2


# -- --on-prefill-failure local ------------------------------------------------------------------


@pytest.mark.parametrize(("error", "reason"), [
    (PrefillFailed("prefill engine answered 500"), "prefill_failed"),
    (InvalidHandoff("no params"), "invalid_handoff"),
    (DeadlineExceeded("prefill timed out"), "deadline_exceeded"),
    (PrefillUnreachable("refused"), "prefill_failed"),  # one candidate: nowhere to retry
])
async def test_a_failed_sequential_prefill_runs_locally(error: Exception, reason: str) -> None:
    calls = FakeCalls()
    counts = counted()
    dialect, flow = trt_flow(calls, on_prefill_failure=LEFT, counts=counts)
    calls.prefill_answers(error)
    calls.decode_answers(FakeUpstream(b"data: local\n\n", b""))
    client = completions_body()
    exchange = await flow.run(pd_request(client))
    assert calls.decodes[0].body == client  # the client's own body, no hand-off
    assert exchange.fallback_reason == reason
    assert counts.fallbacks == [("http", reason)]
    assert exchange.timings.prefill is None
    assert exchange.timings.decode_first_byte is not None
    assert await exchange.read_all(1024) == b"data: local\n\n"
    # The failed pair's dialect state ended once, before the local run (which holds none).
    assert [ctx.request_id for ctx in dialect.ended] == ["rq-1"]
    await exchange.aclose()
    assert [ctx.request_id for ctx in dialect.ended] == ["rq-1"]


async def test_an_unusable_hand_off_falls_back_too() -> None:
    calls = FakeCalls()
    counts = counted()
    flow = flow_of(make_dialect(NixlPullDialect), calls, on_prefill_failure=LEFT, counts=counts)
    calls.prefill_answers({"choices": []})
    calls.decode_answers(FakeUpstream(b""))
    exchange = await flow.run(pd_request(completions_body()))
    assert exchange.fallback_reason == "invalid_handoff"
    assert "kv_transfer_params" not in calls.decodes[0].body


async def test_a_clients_bad_request_is_not_run_locally() -> None:
    calls = FakeCalls()
    counts = counted()
    _, flow = trt_flow(calls, on_prefill_failure=LEFT, counts=counts)
    calls.prefill_answers(EngineRejected("prompt too long"))
    with pytest.raises(EngineRejected):
        await flow.run(pd_request(completions_body()))
    assert calls.decodes == [] and counts.fallbacks == []


async def test_a_concurrent_dialect_never_falls_back() -> None:
    calls = FakeCalls()
    counts = counted()
    _, flow = sglang_flow(calls, on_prefill_failure=LEFT, counts=counts)
    calls.prefill_answers(PrefillFailed("prefill engine answered 500"))
    calls.hold_decode()
    with pytest.raises(PrefillFailed):
        await flow.run(pd_request(completions_body()))
    assert len(calls.decodes) == 1 and calls.cancelled == ["decode"]
    assert counts.fallbacks == []


async def test_the_retry_comes_before_the_local_fallback() -> None:
    calls = FakeCalls()
    counts = counted()
    _, flow = trt_flow(calls, on_prefill_failure=LEFT, counts=counts)
    calls.prefill_answers(PrefillUnreachable("refused"), PrefillUnreachable("refused too"))
    calls.decode_answers(FakeUpstream(b""))
    client = completions_body()
    exchange = await flow.run(pd_request(client, candidates=(TARGET_A, TARGET_B)))
    assert [leg.target for leg in calls.prefills] == [TARGET_A, TARGET_B]
    assert counts.retries == ["http"]
    # The retry failed too: then, and only then, the local engine.
    assert counts.fallbacks == [("http", "prefill_failed")]
    assert exchange.fallback_reason == "prefill_failed"
    assert calls.decodes[0].body == client


# -- a local decision on the local engine ------------------------------------------------------


async def test_a_local_decision_runs_whole_on_the_local_engine() -> None:
    calls = FakeCalls()
    dialect, flow = trt_flow(calls)
    decode = FakeUpstream(b"data: local\n\n", b"")
    calls.decode_answers(decode)
    client = completions_body(prompt=list(range(16)))
    exchange = await flow.run(pd_request(client),
                                Decision(Fate.LOCAL, "local_short", "prompt of 16 tokens"))
    assert calls.prefills == []
    assert calls.decodes[0].body == client
    assert exchange.local and exchange.owner is None and exchange.ctx.state is None
    assert exchange.outcome == "local_short"
    assert dialect.begun == []  # no dialect state for a request without a hand-off
    assert await exchange.read_all(1024) == b"data: local\n\n"
    await exchange.aclose()
    assert decode.closed and calls.aborts == [] and dialect.ended == []


async def test_a_local_fallback_decision_is_counted_with_its_reason() -> None:
    calls, counts = FakeCalls(), counted()
    _, flow = trt_flow(calls, counts=counts)
    calls.decode_answers(FakeUpstream(b""))
    exchange = await flow.run(pd_request(completions_body()), Decision(
        Fate.LOCAL, "fallback", "every breaker open", fallback_reason="breaker_open"))
    assert calls.prefills == [] and exchange.outcome == "fallback"
    assert counts.fallbacks == [("http", "breaker_open")]


async def test_a_pair_decision_runs_on_its_target_and_ranks() -> None:
    calls = FakeCalls()
    _, flow = trt_flow(calls)
    calls.prefill_answers(trt_context())
    calls.decode_answers(FakeUpstream(b""))
    exchange = await flow.run(pd_request(completions_body(), candidates=(TARGET_A, TARGET_B)),
                                Decision(Fate.PAIR, "ok", "prefill on B", target=TARGET_B))
    assert [leg.target for leg in calls.prefills] == [TARGET_B] and not exchange.local

