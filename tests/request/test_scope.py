"""Proves a request's bookkeeping, ``RequestScope`` and ``Scopes`` (sidecar/request/scope.py), on a
real metrics registry and a real admission (no sockets, no server):

- a request is counted once at ``close`` with its last outcome, labelled by front door,
  route, engine and connector; its total time observed once; the in-flight gauge and the
  admission slot taken at ``admit`` are given back;
- a request refused at admission (overloaded, draining) is counted ``refused`` and keeps that
  outcome whatever error it then reports; it never gives back a slot it did not take;
- ``failed``, ``broken`` and ``cancelled`` count their error by stage and code, with the
  outcomes ``error``, ``broken_stream`` and ``cancelled`` (``client_cancelled``);
- ``detach`` shares the slot with a background task: it is left only when both the request
  and the task have ended, in either order, and a second release changes nothing;
- stage timings: each stage that ran is observed, the others not.

It does not prove tracing (tests/tracing) nor the front doors' use of the scope.
"""

from __future__ import annotations

import pytest
from flow_builders import sample, scopes_of

from sidecar.errors import DecodeFailed, Draining, Overloaded, PrefillFailed, Stage
from sidecar.observability.metrics import Metrics
from sidecar.request.scope import (
    BROKEN_STREAM,
    CANCELLED,
    ERROR,
    OK,
    REFUSED,
    Admission,
    Scopes,
    Timings,
)

ROUTE = "/v1/completions"


def door(max_inflight: int = 2) -> tuple[Scopes, Admission]:
    admission = Admission(max_inflight)
    return scopes_of(Metrics(), admission, engine="sglang", connector="none"), admission


def requests(scopes: Scopes, outcome: str, route: str = ROUTE) -> float:
    return sample(scopes.metrics, "disagg_requests_total", front_door="http", route=route,
                  engine="sglang", connector="none", outcome=outcome)


def errors(scopes: Scopes, stage: str, code: str) -> float:
    return sample(scopes.metrics, "disagg_errors_total", front_door="http", stage=stage,
                  code=code)


def stage_count(scopes: Scopes, stage: str) -> float:
    return sample(scopes.metrics, "disagg_stage_seconds_count", front_door="http", stage=stage)


def inflight(scopes: Scopes) -> float:
    return sample(scopes.metrics, "disagg_inflight_requests", front_door="http")


def test_a_request_is_counted_once_with_its_last_outcome() -> None:
    scopes, admission = door()
    scope = scopes.open(ROUTE, "rq-1")
    assert scope.outcome == ERROR  # until the door says otherwise
    scope.admit()
    assert admission.inflight == 1 and inflight(scopes) == 1
    scope.outcome = OK
    scope.close()
    assert requests(scopes, OK) == 1
    assert requests(scopes, ERROR) == 0
    assert stage_count(scopes, "total") == 1
    assert admission.inflight == 0 and inflight(scopes) == 0
    other = scopes.open("/disagg.DecodeWorker/Decode", "rq-2")
    other.admit()
    other.outcome = OK
    other.close()
    assert requests(scopes, OK) == 1  # each route has its own count
    assert requests(scopes, OK, route="/disagg.DecodeWorker/Decode") == 1


@pytest.mark.parametrize("refusal", ["overloaded", "draining"])
def test_a_refused_request_keeps_its_outcome_and_takes_no_slot(refusal: str) -> None:
    scopes, admission = door(max_inflight=1)
    holder = scopes.open(ROUTE, "rq-holder")
    holder.admit()
    if refusal == "draining":
        admission.start_draining()
    scope = scopes.open(ROUTE, "rq-1")
    expected = Overloaded if refusal == "overloaded" else Draining
    with pytest.raises(expected) as raised:
        scope.admit()
    assert scope.outcome == REFUSED
    scope.failed(raised.value)  # the door reports the refusal
    assert scope.outcome == REFUSED
    scope.close()
    assert requests(scopes, REFUSED) == 1
    assert requests(scopes, ERROR) == 0
    assert errors(scopes, "sidecar", refusal) == 1
    assert admission.inflight == 1 and inflight(scopes) == 1  # the holder's, untouched
    holder.close()
    assert admission.inflight == 0 and inflight(scopes) == 0


def test_failed_broken_and_cancelled_count_their_errors() -> None:
    scopes, _ = door(max_inflight=3)
    failed, broken, cancelled = (scopes.open(ROUTE, f"rq-{i}") for i in range(3))
    for scope in (failed, broken, cancelled):
        scope.admit()
    failed.outcome = OK
    failed.failed(PrefillFailed("prefill engine answered 500"))
    assert failed.outcome == ERROR  # a failure after an ok overrides it
    broken.broken(DecodeFailed("decode engine broke its stream"))
    cancelled.cancelled()
    for scope in (failed, broken, cancelled):
        scope.close()
    assert requests(scopes, ERROR) == 1
    assert requests(scopes, BROKEN_STREAM) == 1
    assert requests(scopes, CANCELLED) == 1
    assert errors(scopes, "prefill", "prefill_failed") == 1
    assert errors(scopes, "decode", "decode_failed") == 1
    assert errors(scopes, "sidecar", "client_cancelled") == 1


def test_count_error_counts_an_error_no_request_owns() -> None:
    scopes, _ = door()
    scopes.count_error(PrefillFailed("background prefill failed", stage=Stage.PREFILL))
    assert errors(scopes, "prefill", "prefill_failed") == 1
    assert requests(scopes, ERROR) == 0


async def test_detach_holds_the_slot_until_both_ended() -> None:
    scopes, admission = door()
    scope = scopes.open(ROUTE, "rq-1")
    scope.admit()
    release = scope.detach()
    scope.outcome = OK
    scope.close()
    assert requests(scopes, OK) == 1  # the request is counted when it ends
    assert inflight(scopes) == 0
    assert admission.inflight == 1  # ... but its background task still holds the slot
    assert not await admission.wait_idle(0)
    release()
    assert admission.inflight == 0
    assert await admission.wait_idle(0)
    release()  # once only
    assert admission.inflight == 0


def test_a_background_task_ending_first_leaves_the_slot_to_the_request() -> None:
    scopes, admission = door()
    scope = scopes.open(ROUTE, "rq-1")
    scope.admit()
    release = scope.detach()
    release()
    assert admission.inflight == 1
    scope.close()
    assert admission.inflight == 0


def test_two_detached_tasks_and_the_request_share_one_slot() -> None:
    scopes, admission = door()
    scope = scopes.open(ROUTE, "rq-1")
    scope.admit()
    first, second = scope.detach(), scope.detach()
    scope.close()
    first()
    first()
    assert admission.inflight == 1
    second()
    assert admission.inflight == 0


def test_stage_timings_observe_the_stages_that_ran() -> None:
    scopes, _ = door()
    scope = scopes.open(ROUTE, "rq-1")
    scope.observe_timings(Timings(prefill=0.5, handoff=None, decode_first_byte=0.25))
    metrics = scopes.metrics
    assert stage_count(scopes, "prefill") == 1
    assert sample(metrics, "disagg_stage_seconds_sum", front_door="http", stage="prefill") == 0.5
    assert stage_count(scopes, "handoff") == 0
    assert sample(metrics, "disagg_stage_seconds_sum", front_door="http",
                  stage="decode_first_byte") == 0.25
    scope.observe_timings(Timings())
    assert stage_count(scopes, "prefill") == 1
    scope.observe("prefill", 1.5)
    assert sample(metrics, "disagg_stage_seconds_sum", front_door="http", stage="prefill") == 2.0


def test_relayed_bytes_are_the_front_doors() -> None:
    scopes, _ = door()
    scopes.open(ROUTE, "rq-1").relayed_bytes.inc(42)
    assert sample(scopes.metrics, "disagg_relayed_bytes_total", front_door="http") == 42
    assert scopes.open(ROUTE).front_door == "http"
