"""Proves a pair never joins two engines that cannot hand KV off (issue 34 item 7):

- a prefill target serving another model (a stub answering as ``other-model-rev2`` behind a
  decode engine serving ``stub-model``) gets no leg: 502 ``prefill_target_mismatch`` naming
  both models (it got 4 of 4, each decode leg carrying its hand-off), or, under
  ``--on-prefill-failure local``, the local engine serves the request whole; counted in
  ``disagg_prefill_mismatches_total``, never against the target's circuit breaker;
- the same served name with other weights (``root``: another revision) is another model;
- another KV cache dtype (vLLM's ``vllm:cache_config_info``) is another layout;
- a target that does not say what it serves gets no leg ("never"), one that is down is the
  legs' business (refused, unreachable, counted by its breaker, as before);
- of several targets, only those that can hand off are picked, and a retry after a leg that
  did no work moves only to one asked and able (``placement.after_failure``);
- the facts: ``mismatch`` and the vLLM metrics line they are read from.

Runs the stub engines (vLLM NIXL pull) behind a real sidecar.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
from sidecar_builders import RunningSidecar, refusing_port, running_sidecar

from sidecar.dialects.vllm import cache_config
from sidecar.engines.models import Mismatch, NotLearned, Serves, mismatch
from sidecar.errors import PrefillUnreachable
from sidecar.protocol.context import PrefillTarget, Route
from sidecar.request.placement import Decision, Fate, Rules, after_failure
from sidecar.tools.stubs.config import StubConfig
from sidecar.tools.stubs.faults import Fault, FaultKind
from sidecar.tools.stubs.server import Stub, run_stub

COMPLETIONS = Route.COMPLETIONS.value
BODY = {"model": "stub-model", "prompt": "Hello there", "max_tokens": 4}


@contextlib.asynccontextmanager
async def stubs(*prefills: dict[str, Any]) -> AsyncIterator[tuple[list[Stub], Stub]]:
    """Prefill stubs (each with its config overrides) and a decode stub serving stub-model."""
    async with contextlib.AsyncExitStack() as stack:
        started = [await stack.enter_async_context(run_stub(StubConfig(
            engine="vllm", role="prefill", **overrides))) for overrides in prefills]
        decode = await stack.enter_async_context(run_stub(StubConfig(engine="vllm",
                                                                     role="decode")))
        yield started, decode


def sidecar_for(decode: Stub, *prefills: Stub | int, **overrides: Any) -> Any:
    ports = [p if isinstance(p, int) else p.port for p in prefills]
    return running_sidecar(engine="vllm", engine_url=decode.url, grpc_enabled=False,
                           prefill_allowlist=tuple(f"127.0.0.1:{port}" for port in ports),
                           **overrides)


async def post(sidecar: RunningSidecar, targets: Sequence[Stub | int]) -> tuple[int, Any]:
    header = ",".join(f"127.0.0.1:{t if isinstance(t, int) else t.port}" for t in targets)
    async with aiohttp.ClientSession() as client, client.post(
            sidecar.url + COMPLETIONS, json=BODY,
            headers={"x-prefiller-host-port": header}) as response:
        return response.status, await response.json()


def legs(stub: Stub) -> int:
    return len(stub.recorder.on_path(COMPLETIONS))


async def test_a_target_serving_another_model_gets_no_leg() -> None:
    async with stubs({"model": "other-model-rev2"}) as ([other], decode):
        async with sidecar_for(decode, other) as sidecar:
            for _ in range(4):
                status, payload = await post(sidecar, [other])
                assert status == 502, payload
                error = payload["error"]
                assert error["code"] == "prefill_target_mismatch"
                assert "other-model-rev2" in error["message"]
                assert "stub-model" in error["message"]
            assert legs(other) == 0 and legs(decode) == 0
            assert await sidecar.metric("disagg_prefill_mismatches_total", target="header",
                                        kind="model") == 4
            assert await sidecar.metric("disagg_prefill_breaker_state", target="header") == 0


async def test_under_local_fallback_the_local_engine_serves_it_whole() -> None:
    async with stubs({"model": "other-model-rev2"}) as ([other], decode):
        async with sidecar_for(decode, other, on_prefill_failure="local") as sidecar:
            for _ in range(4):
                status, payload = await post(sidecar, [other])
                assert status == 200, payload
            assert legs(other) == 0
            # Each decode leg is the client's own body: no hand-off from the other model.
            assert all("kv_transfer_params" not in r.json for r in decode.recorder.on_path(
                COMPLETIONS))
            assert await sidecar.metric("disagg_prefill_fallbacks_total",
                                        reason="prefill_target_mismatch") == 4


async def test_another_revision_under_the_same_name_is_another_model() -> None:
    async with stubs({"model_root": "/models/stub-model-rev2"}) as ([rev2], decode):
        async with sidecar_for(decode, rev2) as sidecar:
            status, payload = await post(sidecar, [rev2])
            assert status == 502 and "/models/stub-model-rev2" in payload["error"]["message"]
            assert legs(rev2) == 0


async def test_another_kv_cache_dtype_is_another_layout() -> None:
    async with stubs({"kv_cache_dtype": "fp8_e4m3"}) as ([fp8], decode):
        async with sidecar_for(decode, fp8) as sidecar:
            status, payload = await post(sidecar, [fp8])
            assert status == 502 and "fp8_e4m3" in payload["error"]["message"]
            assert legs(fp8) == 0
            assert await sidecar.metric("disagg_prefill_mismatches_total",
                                        kind="kv_layout") == 1


async def test_a_target_that_does_not_say_what_it_serves_gets_no_leg() -> None:
    broken = Fault(kind=FaultKind.STATUS, status=500, path="/v1/models")
    async with stubs({"faults": (broken,)}) as ([mute], decode):
        async with sidecar_for(decode, mute) as sidecar:
            status, payload = await post(sidecar, [mute])
            assert status == 502 and "HTTP 500" in payload["error"]["message"]
            assert legs(mute) == 0
            assert await sidecar.metric("disagg_prefill_mismatches_total",
                                        kind="unknown") == 1
            mute.faults.clear()
            status, payload = await post(sidecar, [mute])  # asked again: it says now
            assert status == 200, payload
            assert legs(mute) == 1



async def test_of_several_targets_only_those_that_can_hand_off_get_legs() -> None:
    with refusing_port() as dead:
        async with stubs({"model": "other-model-rev2"}, {}) as ([other, same], decode):
            async with sidecar_for(decode, other, same, dead, prefill_cooldown_s=0) as sidecar:
                for _ in range(8):
                    status, payload = await post(sidecar, [other, same])
                    assert status == 200, payload
                assert legs(other) == 0 and legs(same) == 8
                # A down target is health's business: refused, then moved to the other.
                for _ in range(4):
                    status, payload = await post(sidecar, [dead, same])
                    assert status == 200, payload
                assert legs(same) == 12
                status, payload = await post(sidecar, [dead])
                assert status == 502 and payload["error"]["code"] == "prefill_failed"


def test_a_retry_moves_only_to_a_target_asked_and_able() -> None:
    a, b, c = (PrefillTarget(f"10.0.0.{n}", 8000) for n in (1, 2, 3))

    class Targets:
        def pick(self, candidates: Sequence[PrefillTarget],
                 exclude: Any = ()) -> PrefillTarget | None:
            left = [t for t in candidates if t not in exclude]
            return left[0] if left else None

        def prefill_rank(self, target: PrefillTarget, named: int | None) -> int | None:
            return None

        def decode_rank(self) -> int | None:
            return None

    decision = Decision(Fate.PAIR, "ok", "", target=a, able=(a, c))
    refused = PrefillUnreachable("refused")
    following = after_failure(decision, refused, (a, b, c), None, Rules(), Targets(),  # type: ignore[arg-type]
                              decode_sent=False)
    assert following.target == c  # b was not asked (its breaker kept it out then)
    unasked = Decision(Fate.PAIR, "ok", "", target=a)  # no check made: any other
    assert after_failure(unasked, refused, (a, b, c), None, Rules(), Targets(),  # type: ignore[arg-type]
                         decode_sent=False).target == b


def test_the_facts_compared() -> None:
    local = Serves("m", "/models/m", (("cache_dtype", "auto"),))
    assert mismatch(local, local) is None
    assert mismatch(local, Serves("m", None)) is None  # states no root, no layout
    assert mismatch(local, Serves("n", "/models/m")) == Mismatch(
        "model", "it serves n (/models/m), the local engine m (/models/m)")
    assert mismatch(local, Serves("m", "/models/m-rev2")).kind == "model"  # type: ignore[union-attr]
    assert mismatch(local, Serves("m", "/models/m", (("cache_dtype", "fp8"),))).kind == (  # type: ignore[union-attr]
        "kv_layout")
    assert mismatch(local, NotLearned("HTTP 500")).kind == "unknown"  # type: ignore[union-attr]
    assert mismatch(local, NotLearned("refused", down=True)) is None
    assert mismatch(NotLearned("HTTP 404"), local).kind == "unknown"  # type: ignore[union-attr]
    assert cache_config(b'# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{'
                        b'block_size="16",cache_dtype="fp8",engine="0"} 1.0\n') == {
        "cache_dtype": "fp8"}
    assert cache_config(b"vllm:num_requests_running 0\n") is None
