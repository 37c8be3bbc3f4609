"""Proves the flow's one-leg half and its per-request state (sidecar/request/runner.py), on real
dialects over fake engine calls, a real metrics registry and a real admission (no sockets):

- ``prefill_only`` (gRPC Prefill), sequential (TensorRT-LLM): the prefill goes to the local
  engine with the dialect's body and a gRPC context, within the caller's remaining time;
  returns the hand-off's fields; stage timings land in the request scope; the state ends
  with the call, failed or not; a prefill that already is the answer is returned and
  counted ``answered_by_prefill``;
- ``prefill_only``, concurrent (SGLang): the hand-off (an int32 room, this pod's advertise
  host) comes back at once while the engine call runs on in the background under the
  prefill timeout, not the caller's; that background leg holds the admission slot and the
  room until it ends (whichever of it and the request ends first), its time is observed,
  its failure counted through the scopes (a crash as ``internal_error``), and ``close()``
  cancels it (counting nothing);
- ``begin``: a dialect that looks up (vLLM Mooncake) gets the looked-up engine id into its
  hand-off, and its state is ended when the lookup fails or is cancelled.

It does not prove the gRPC service around it (tests/grpc_server) nor the engine calls.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from flow_builders import (
    ENGINE_URL,
    TARGET_A,
    FakeCalls,
    FakeUpstream,
    counted,
    flow_of,
    pd_request,
    recording,
    sample,
    scopes_of,
)
from protocol_builders import FIXED_NOW_MS, completions_body, make_dialect

from sidecar.dialects.base import LookupFailed
from sidecar.dialects.sglang import INT32_ROOMS, SGLangDialect
from sidecar.dialects.trtllm import TRTLLMDialect, snowflake_id
from sidecar.dialects.vllm_mooncake import MooncakeDialect, MooncakeState
from sidecar.errors import InvalidHandoff, PrefillFailed
from sidecar.observability.metrics import Metrics
from sidecar.protocol.context import FrontDoor, PrefillTarget, Route
from sidecar.request.scope import OK, Admission, RequestScope, Scopes

FIRST_ID = snowflake_id(FIXED_NOW_MS, 0, 0)
POD = PrefillTarget("10.0.0.9", 8000)
GRPC_CLIENT: dict[str, Any] = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 1,
                               "temperature": 0.0}


class Door:
    """The gRPC door's bookkeeping: real metrics and admission, one admitted request."""

    def __init__(self) -> None:
        self.metrics = Metrics()
        self.admission = Admission(4)
        self.scopes: Scopes = scopes_of(self.metrics, self.admission, front_door="grpc")
        self.scope: RequestScope = self.scopes.open("/disagg.PrefillWorker/Prefill", "rq-1")
        self.scope.admit()

    def stage_count(self, stage: str) -> float:
        return sample(self.metrics, "disagg_stage_seconds_count", front_door="grpc",
                      stage=stage)

    def errors(self, code: str, stage: str = "prefill") -> float:
        return sample(self.metrics, "disagg_errors_total", front_door="grpc", stage=stage,
                      code=code)


async def prefill_only(flow: Any, door: Door, time_remaining: float | None = 0.5) -> Any:
    return await flow.prefill_only(
        GRPC_CLIENT, request_id="rq-1", target=POD, advertise_host=POD.host,
        headers={"X-Request-Id": "rq-1"}, time_remaining=time_remaining,
        scope=door.scope, scopes=door.scopes)


def trt_context(finish_reason: str = "length") -> dict[str, Any]:
    return {"choices": [{"text": "", "finish_reason": finish_reason,
                         "disaggregated_params": {"request_type": "context_only",
                                                  "disagg_request_id": FIRST_ID}}],
            "prompt_token_ids": [5, 6, 7]}


# -- sequential ------------------------------------------------------------------------------


async def test_sequential_prefill_only_returns_the_hand_off() -> None:
    door = Door()
    calls = FakeCalls()
    dialect = make_dialect(recording(TRTLLMDialect))
    flow = flow_of(dialect, calls, prefill_timeout_s=30)
    calls.prefill_answers(trt_context())

    handoff = await prefill_only(flow, door)

    (leg,) = calls.prefills
    assert leg.url == ENGINE_URL + "/v1/completions"
    assert leg.target is None  # the local engine: not a remote target's leg
    assert leg.timeout_s == 0.5  # the caller's deadline is the shorter
    assert leg.body == {**GRPC_CLIENT, "stream": False, "disaggregated_params": {
        "request_type": "context_only", "disagg_request_id": FIRST_ID}}
    assert handoff.fields == {"disaggregated_params": {"request_type": "generation_only",
                                                       "disagg_request_id": FIRST_ID},
                              "prompt": [5, 6, 7]}
    assert handoff.answer is None
    (ctx,) = dialect.begun
    assert ctx.front_door is FrontDoor.GRPC and ctx.route is Route.COMPLETIONS
    assert ctx.prefill == POD and ctx.advertise_host == POD.host
    assert dialect.ended == [ctx]
    assert door.stage_count("prefill") == 1
    assert door.stage_count("handoff") == 1


@pytest.mark.parametrize(("time_remaining", "timeout_s"),
                         [(None, 30.0), (100.0, 30.0), (0.0, 0.001), (-1.0, 0.001)])
async def test_the_prefill_deadline_is_the_shorter_of_both(
    time_remaining: float | None, timeout_s: float
) -> None:
    calls = FakeCalls()
    flow = flow_of(make_dialect(TRTLLMDialect), calls, prefill_timeout_s=30)
    calls.prefill_answers(trt_context())
    await prefill_only(flow, Door(), time_remaining)
    assert calls.prefills[0].timeout_s == timeout_s


async def test_a_prefill_that_is_the_answer_is_returned_and_counted() -> None:
    calls = FakeCalls()
    counts = counted()
    dialect = make_dialect(recording(TRTLLMDialect))
    flow = flow_of(dialect, calls, counts=counts)
    calls.prefill_answers(trt_context(finish_reason="stop"))
    handoff = await prefill_only(flow, Door())
    assert handoff.fields == {}
    assert handoff.answer == {"choices": [{"text": "", "finish_reason": "stop"}],
                              "prompt_token_ids": [5, 6, 7]}
    assert counts.fallbacks == [("grpc", "answered_by_prefill")]
    assert len(dialect.ended) == 1


async def test_a_failed_sequential_prefill_only_ends_the_state() -> None:
    door = Door()
    calls = FakeCalls()
    dialect = make_dialect(recording(TRTLLMDialect))
    flow = flow_of(dialect, calls)
    calls.prefill_answers(PrefillFailed("prefill engine answered 500"))
    with pytest.raises(PrefillFailed):
        await prefill_only(flow, door)
    assert dialect.ended == dialect.begun and len(dialect.begun) == 1
    assert door.stage_count("prefill") == 0  # the stage did not end
    assert door.errors("prefill_failed") == 0  # the request's scope counts it, not the flow


# -- concurrent: the background prefill -------------------------------------------------------


def sglang(calls: FakeCalls) -> tuple[Any, Any]:
    dialect = make_dialect(recording(SGLangDialect), sglang_bootstrap_port=9001)
    return dialect, flow_of(dialect, calls, prefill_timeout_s=30)


async def test_concurrent_prefill_only_hands_off_at_once_and_holds_the_slot() -> None:
    door = Door()
    calls = FakeCalls()
    dialect, flow = sglang(calls)
    held = calls.hold_prefill()

    handoff = await prefill_only(flow, door)

    room = handoff.fields["bootstrap_room"]
    assert 0 <= room <= INT32_ROOMS  # SGLang's own gRPC path carries int32 rooms
    assert handoff.fields == {"bootstrap_host": POD.host, "bootstrap_port": 9001,
                              "bootstrap_room": room, "rid": f"rq-1-{room}"}
    await calls.until(prefills=1)
    (leg,) = calls.prefills
    assert leg.url == ENGINE_URL + "/v1/completions"
    assert leg.timeout_s == 30.0  # the call outlives the RPC: its own deadline
    assert leg.body["bootstrap_room"] == room
    assert not held.done()

    door.scope.outcome = OK
    door.scope.close()
    assert door.admission.inflight == 1  # the background leg holds the slot
    assert sample(door.metrics, "disagg_inflight_requests", front_door="grpc") == 0
    assert dialect.rooms.in_flight() == 1

    held.set_result({"choices": []})
    assert await door.admission.wait_idle(5)
    assert dialect.rooms.in_flight() == 0
    assert len(dialect.ended) == 1
    assert door.stage_count("prefill") == 1


async def test_a_background_prefill_ending_first_leaves_the_slot_to_the_request() -> None:
    door = Door()
    calls = FakeCalls()
    dialect, flow = sglang(calls)
    calls.hold_prefill().set_result({"choices": []})
    await prefill_only(flow, door)
    await dialect.end_seen.wait()
    assert door.admission.inflight == 1  # the request still holds it
    door.scope.close()
    assert door.admission.inflight == 0


@pytest.mark.parametrize(("raised", "code"), [
    (PrefillFailed("prefill engine answered 500"), "prefill_failed"),
    (RuntimeError("boom"), "internal_error"),
], ids=["failed", "crash"])
async def test_a_failed_background_prefill_is_counted_and_gives_everything_back(
    raised: Exception, code: str
) -> None:
    door = Door()
    calls = FakeCalls()
    dialect, flow = sglang(calls)
    held = calls.hold_prefill()
    await prefill_only(flow, door)
    door.scope.close()
    held.set_exception(raised)
    assert await door.admission.wait_idle(5)
    assert door.errors(code) == 1
    assert dialect.rooms.in_flight() == 0
    assert door.stage_count("prefill") == 0


async def test_close_cancels_the_background_prefills() -> None:
    door = Door()
    calls = FakeCalls()
    dialect, flow = sglang(calls)
    calls.hold_prefill()
    await prefill_only(flow, door)
    await calls.until(prefills=1)
    door.scope.close()
    await flow.close()
    assert calls.cancelled == ["prefill"]
    assert door.admission.inflight == 0
    assert dialect.rooms.in_flight() == 0
    assert door.errors("prefill_failed") == door.errors("internal_error") == 0
    await flow.close()  # nothing left: a second close is harmless


# -- begin: the dialect state and its lookup ----------------------------------------------------


class Lookup:
    """An ``EngineLookup`` answering from a script (an answer, an error, or a held future)."""

    def __init__(self, outcome: Any) -> None:
        self.outcome = outcome
        self.urls: list[str] = []
        self.asked = asyncio.Event()

    async def get(self, url: str, *, max_bytes: int) -> tuple[int, bytes]:
        self.urls.append(url)
        self.asked.set()
        outcome = self.outcome
        if isinstance(outcome, asyncio.Future):
            outcome = await outcome
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome  # type: ignore[no-any-return]


def mooncake(lookup: Lookup, calls: FakeCalls) -> tuple[Any, Any]:
    dialect = make_dialect(recording(MooncakeDialect), lookup=lookup,
                           mooncake_bootstrap_port=8998)
    return dialect, flow_of(dialect, calls)


async def test_begin_looks_up_the_engine_id_for_the_hand_off() -> None:
    calls = FakeCalls()
    lookup = Lookup((200, b'{"0": {"engine_id": "engine-7"}}'))
    _, flow = mooncake(lookup, calls)
    held = calls.hold_prefill()
    calls.decode_answers(FakeUpstream(b""))
    exchange = await flow.run(pd_request(completions_body()))
    assert lookup.urls == ["http://10.0.0.1:8998/query"]
    assert exchange.ctx.state == MooncakeState("xfer-fixed", "engine-7")
    params = calls.decodes[0].body["kv_transfer_params"]
    assert params["remote_engine_id"] == "engine-7"
    assert params["remote_bootstrap_addr"] == "http://10.0.0.1:8998"
    held.set_result({})
    await exchange.aclose()


@pytest.mark.parametrize("outcome", [LookupFailed("unreachable"), (503, b"")],
                         ids=["unreachable", "http_503"])
async def test_a_failed_lookup_ends_the_state(outcome: Any) -> None:
    calls = FakeCalls()
    dialect, flow = mooncake(Lookup(outcome), calls)
    with pytest.raises(InvalidHandoff):
        await flow.begin(Route.COMPLETIONS, "rq-1", TARGET_A)
    assert dialect.ended == dialect.begun and len(dialect.begun) == 1
    with pytest.raises(InvalidHandoff):
        await flow.run(pd_request(completions_body()))
    assert len(dialect.ended) == len(dialect.begun) == 2
    assert calls.prefills == [] and calls.decodes == []


async def test_a_lookup_cancelled_ends_the_state() -> None:
    calls = FakeCalls()
    held: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    lookup = Lookup(held)
    dialect, flow = mooncake(lookup, calls)
    task = asyncio.ensure_future(flow.begin(Route.COMPLETIONS, "rq-1", TARGET_A))
    await lookup.asked.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert dialect.ended == dialect.begun and len(dialect.begun) == 1
