"""Proves the NIXL push dialect (docs/driving/nixl-push.md) without engines: the bodies, the
identity.

The prefill body gets exactly the two keys vLLM 0.32's push prefill reads; the decode body
exactly the keys its push decode reads, from a prefill answer (a learning request) or from a
known identity (both legs at once), with the prefill target's host; the first request to a
target learns, concurrent first requests wait for it and learn once, an answer with another
identity replaces the cached one (and says the decode's was stale), a refused prefill connect
forgets it, the cache holds at most its bound; an operator-given identity makes the first
request concurrent, per data-parallel rank as vLLM names ranks; malformed answers are
``InvalidHandoff``. Does not run legs (tests/http/test_nixl_push_flows.py does).
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
from protocol_builders import OPENAI_ROUTE_LIST, chat_body, completions_body, make_ctx, make_dialect

from sidecar.dialects import DIALECTS, Legs
from sidecar.dialects.vllm_nixl_push import (
    NixlPushDialect,
    PrefillIdentity,
    PushState,
    identity_from_answer,
)
from sidecar.errors import EngineNotReady, InvalidHandoff, PrefillFailed, PrefillUnreachable
from sidecar.protocol.context import FrontDoor, HandoffContext, Route


def push_answer(engine_id: str = "push-p-1", port: int = 5601, **changes: Any) -> dict[str, Any]:
    """A vLLM 0.32 push prefill's answer (the keys and order of the issue's recording)."""
    params: dict[str, Any] = {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
        "remote_engine_id": engine_id, "remote_request_id": "cmpl-req-1-0-0a1b2c3d",
        "remote_host": "127.0.0.1", "remote_port": port, "tp_size": 1, "dcp_size": 1,
        "pp_size": 1, "remote_num_tokens": 40, "transfer_mode": "push",
        "remote_prefill_cached_tokens": 0,
    }
    params.update(changes)
    return {"id": "cmpl-req-1", "choices": [], "kv_transfer_params": params}


def decode_params(engine_id: str = "push-p-1", port: int = 5601, host: str = "10.0.0.7",
                  request_id: str = "cmpl-req-1-0-0a1b2c3d") -> dict[str, Any]:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
            "remote_host": host, "remote_port": port, "tp_size": 1, "pp_size": 1,
            "dcp_size": 1, "remote_request_id": request_id}


def looked_up(dialect: NixlPushDialect, ctx: HandoffContext) -> HandoffContext:
    return asyncio.run(dialect.look_up(ctx))


def test_registered_under_its_label_with_vllms_class_name_as_alias() -> None:
    assert DIALECTS.get("vllm", "nixl-push") is NixlPushDialect
    assert NixlPushDialect.aliases == ("NixlPushConnector",)
    assert NixlPushDialect.legs is Legs.CONCURRENT and NixlPushDialect.looks_up
    assert NixlPushDialect.learns


@pytest.mark.parametrize("route", OPENAI_ROUTE_LIST)
def test_first_request_learns_from_the_prefill_answer(route: Route) -> None:
    dialect = make_dialect(NixlPushDialect)
    client = completions_body() if route is Route.COMPLETIONS else chat_body()
    before = copy.deepcopy(client)
    ctx = looked_up(dialect, make_ctx(route))
    assert ctx.state.learner and dialect.legs_for(ctx) is Legs.SEQUENTIAL
    prefill = dialect.prefill_body(client, ctx)
    assert prefill["kv_transfer_params"] == {"do_remote_decode": True,
                                             "do_remote_prefill": False}
    decode = dialect.decode_body(client, dialect.handoff(push_answer(), ctx))
    # The answer's remote_host (the engine's VLLM_NIXL_SIDE_CHANNEL_HOST) is replaced by the
    # target's; the answer's remote_request_id is the prefill's own.
    assert decode["kv_transfer_params"] == decode_params()
    assert list(decode["kv_transfer_params"]) == list(decode_params())
    assert client == before
    dialect.end(ctx)
    # The next request to the target knows it: both legs at once, the request id paired.
    ctx = looked_up(dialect, make_ctx(route))
    assert dialect.legs_for(ctx) is Legs.CONCURRENT
    assert dialect.handoff(None, ctx)["kv_transfer_params"] == decode_params(
        request_id="req-1")


def test_identity_is_per_target_and_per_rank() -> None:
    dialect = make_dialect(NixlPushDialect, prefill_ranks=2)
    ctx = looked_up(dialect, make_ctx(prefill_rank=1))
    dialect.handoff(push_answer("p_dp1", 5602), ctx)
    dialect.end(ctx)
    assert dialect.legs_for(looked_up(dialect, make_ctx(prefill_rank=1))) is Legs.CONCURRENT
    for other in (make_ctx(prefill_rank=0), make_ctx(host="10.0.0.9", prefill_rank=1)):
        assert dialect.legs_for(looked_up(dialect, other)) is Legs.SEQUENTIAL


def test_concurrent_first_requests_learn_once() -> None:
    dialect = make_dialect(NixlPushDialect)

    async def scenario() -> list[HandoffContext]:
        first = await dialect.look_up(make_ctx())
        waiters = [asyncio.ensure_future(dialect.look_up(make_ctx())) for _ in range(3)]
        await asyncio.sleep(0)
        assert not any(w.done() for w in waiters)  # they wait for the learner
        dialect.handoff(push_answer(), first)
        dialect.end(first)
        return [first, *await asyncio.gather(*waiters)]

    first, *others = asyncio.run(scenario())
    assert first.state.learner
    assert all(dialect.legs_for(ctx) is Legs.CONCURRENT for ctx in others)
    assert {ctx.state.identity for ctx in others} == {PrefillIdentity("push-p-1", 5601)}


def test_a_learner_that_learned_nothing_hands_over_to_one_waiter() -> None:
    dialect = make_dialect(NixlPushDialect)

    async def scenario() -> list[bool]:
        first = await dialect.look_up(make_ctx())
        waiters = [asyncio.ensure_future(dialect.look_up(make_ctx())) for _ in range(2)]
        await asyncio.sleep(0)
        dialect.end(first)  # its prefill failed: no identity
        got = await asyncio.wait_for(asyncio.shield(waiters[0]), 1.0)
        done = [w.done() for w in waiters]
        assert got.state.learner and not done[1]
        dialect.end(got)
        second = await asyncio.wait_for(waiters[1], 1.0)
        dialect.end(second)
        return [got.state.learner, second.state.learner]

    assert asyncio.run(scenario()) == [True, True]


def test_a_cancelled_waiter_leaves_the_learner_alone() -> None:
    dialect = make_dialect(NixlPushDialect)

    async def scenario() -> HandoffContext:
        first = await dialect.look_up(make_ctx())
        waiter = asyncio.ensure_future(dialect.look_up(make_ctx()))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        dialect.handoff(push_answer(), first)
        dialect.end(first)
        return await dialect.look_up(make_ctx())

    assert asyncio.run(scenario()).state.identity == PrefillIdentity("push-p-1", 5601)


def test_an_answer_with_another_identity_replaces_it_and_says_stale() -> None:
    dialect = make_dialect(NixlPushDialect)
    learner = looked_up(dialect, make_ctx())
    dialect.handoff(push_answer(), learner)
    dialect.end(learner)
    ctx = looked_up(dialect, make_ctx())
    assert not dialect.answered_stale(push_answer(), ctx)
    assert dialect.answered_stale(push_answer("push-p-2"), ctx)  # the engine restarted
    assert looked_up(dialect, make_ctx()).state.identity == PrefillIdentity("push-p-2", 5601)
    # An answer without usable params says nothing.
    assert not dialect.answered_stale({"choices": []}, ctx)


def test_a_refused_prefill_connect_forgets_the_identity() -> None:
    dialect = make_dialect(NixlPushDialect)
    learner = looked_up(dialect, make_ctx())
    dialect.handoff(push_answer(), learner)
    dialect.end(learner)
    ctx = looked_up(dialect, make_ctx())
    dialect.leg_failed(PrefillFailed("prefill engine answered HTTP 500"), ctx)
    dialect.leg_failed(EngineNotReady("local engine refused the connection"), ctx)
    assert dialect.legs_for(looked_up(dialect, make_ctx())) is Legs.CONCURRENT
    dialect.leg_failed(PrefillUnreachable("prefill engine refused the connection"), ctx)
    assert dialect.legs_for(looked_up(dialect, make_ctx())) is Legs.SEQUENTIAL


def test_the_cache_is_bounded_oldest_learned_out_first() -> None:
    dialect = make_dialect(NixlPushDialect, nixl_push_identities=2)
    for port in (8001, 8002, 8003):
        ctx = looked_up(dialect, make_ctx(port=port))
        dialect.handoff(push_answer(f"p-{port}"), ctx)
        dialect.end(ctx)
    assert len(dialect.identities) == 2
    assert looked_up(dialect, make_ctx(port=8001)).state.learner
    assert not looked_up(dialect, make_ctx(port=8003)).state.learner


def test_an_operator_given_identity_makes_the_first_request_concurrent() -> None:
    dialect = make_dialect(NixlPushDialect, nixl_push_engine_id="prefill-a",
                           nixl_push_side_channel_port=5700, nixl_push_tp_size=2)
    ctx = looked_up(dialect, make_ctx())
    assert dialect.legs_for(ctx) is Legs.CONCURRENT
    params = dialect.handoff(None, ctx)["kv_transfer_params"]
    assert (params["remote_engine_id"], params["remote_port"], params["tp_size"]) == (
        "prefill-a", 5700, 2)
    # A learned identity wins over the given one (the operator's may be out of date).
    assert dialect.answered_stale(push_answer("prefill-b"), ctx)
    assert looked_up(dialect, make_ctx()).state.identity.engine_id == "prefill-b"


@pytest.mark.parametrize("front_door", [FrontDoor.HTTP, FrontDoor.GRPC])
def test_an_operator_given_identity_per_rank_as_vllm_names_them(front_door: FrontDoor) -> None:
    dialect = make_dialect(NixlPushDialect, nixl_push_engine_id="prefill-a",
                           nixl_push_side_channel_port=5700, prefill_ranks=2, local_ranks=2)
    ctx = looked_up(dialect, make_ctx(prefill_rank=1, front_door=front_door))
    assert ctx.state.identity == PrefillIdentity("prefill-a_dp1", 5701)


def test_the_operator_identity_comes_from_the_pod_annotation_key() -> None:
    options = NixlPushDialect.Options
    assert options is not None
    source = options.pod_sources["nixl_push_engine_id"]
    assert (source.kind, source.key_field) == ("annotation", "nixl_push_engine_id_annotation")


@pytest.mark.parametrize(("answer", "says"), [
    (None, "identity"),
    ({"choices": []}, "no kv_transfer_params"),
    ({"kv_transfer_params": []}, "expected an object"),
    (push_answer(transfer_mode="pull"), "another mode than push"),
    (push_answer(remote_engine_id=""), "remote_engine_id"),
    (push_answer(remote_port=None), "lacks remote_port"),
    (push_answer(remote_port=70000), "not a port"),
    (push_answer(tp_size=None), "lacks tp_size"),
    (push_answer(tp_size=True), "tp_size is not a positive integer"),
    (push_answer(pp_size=0), "pp_size is not a positive integer"),
])
def test_unusable_answers_are_invalid_handoffs(answer: dict[str, Any] | None, says: str) -> None:
    with pytest.raises(InvalidHandoff, match=says):
        identity_from_answer(answer)


def test_defaults_for_keys_vllm_reads_with_defaults() -> None:
    answer = push_answer()
    for key in ("pp_size", "dcp_size", "transfer_mode"):
        del answer["kv_transfer_params"][key]
    assert identity_from_answer(answer) == PrefillIdentity("push-p-1", 5601, 1, 1, 1)


def test_a_learner_without_an_answer_is_refused() -> None:
    dialect = make_dialect(NixlPushDialect)
    ctx = looked_up(dialect, make_ctx())
    assert ctx.state == PushState(ctx.state.key, None, learner=True)
    with pytest.raises(InvalidHandoff):
        dialect.handoff(None, ctx)
