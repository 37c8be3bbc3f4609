"""Real vLLM engines (CPU) with two data-parallel ranks behind the sidecar
(docs/operating/data-parallel.md).

A prefill engine runs ``--data-parallel-size 2`` (one API server, internal load balancing,
each rank its own engine core and KV cache, pinned to its own core: ``VLLM_CPU_OMP_THREADS_BIND
'0|1'``); the decode engine has one rank. The sidecar runs as its own process with
``--prefill-data-parallel-size 2``. Proves, for NixlConnector and MooncakeConnector:

- greedy output through the sidecar equals the decode engine's own full computation of the
  same prompt (no connector involved), token for token, on every request;
- both prefill ranks were used: vLLM's per-rank counters (``vllm:request_success_total
  {engine="0"|"1"}``) grow on each rank, as do the sidecar's ``disagg_rank_legs_total``;
- the KV really moved: the decode engine's external-cache hits grow by the prompt's tokens;
- a rank the router names (``x-data-parallel-rank``) is the rank that prefills;
- Mooncake: the one bootstrap server's ``/query`` lists each rank's own engine id
  (``<id>_dp<r>``), the one the sidecar names for a leg prefilled there (the output equality
  above needs it: a decode naming another rank's id fails, as the research recorded in
  tests/fixtures/vllm/0.32.0/dp_probe_evidence.json).

Runs the two connectors one after the other (class-scoped engines): on two cores a DP 2
engine and its decode are three engine cores already, and the decode runs unpinned
(``UNPINNED``). Each class warms both ranks first, one request through the sidecar each,
restarting the engines once where vLLM's data-parallel stall hits a first transfer
(``WARM_UP_S``). Does not prove: the external load-balancing shape (one API server per
rank; vLLM refuses it for dense models and its CPU build cannot serve MoE data parallelism,
see docs/operating/data-parallel.md), SGLang or TensorRT-LLM ranks.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from real_vllm.client import (
    block_prompt,
    completion_body,
    get_text,
    metric_value,
    post_json,
    text_of,
)
from real_vllm.harness import (
    Engine,
    EngineEnv,
    EngineGroup,
    EngineSpec,
    free_port_run,
    mooncake_config,
    nixl_config,
)
from real_vllm.sidecar_process import Sidecar, sidecar_process, through, wait_ready
from sidecar.dialects.vllm_mooncake import engine_id_from_query

COMPLETIONS = "/v1/completions"
SUCCESS = "vllm:request_success_total"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
RANK_LEGS = "disagg_rank_legs_total"
DP2_ARGS = ("--data-parallel-size", "2")
#: One core per rank (vLLM's CPU build splits the list by local data-parallel rank).
DP2_BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
#: The decode engine on no core of its own: pinned to one prefill rank's core on two cores it
#: starves that rank (Mooncake: the rank's pushes fail every time; NIXL: a pull from the rank
#: stalls past the client's 120 s now and then, 4 of 8 runs at load 10-20). Not a rank bug.
UNPINNED = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
MOONCAKE_ENGINE_ID = "dp2-mooncake-prefill"
#: A Mooncake decode that names a rank that never pushes waits this long (vLLM: 480 s).
MOONCAKE_ABORT = {"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": "30"}
REQUESTS = 4
#: vLLM 0.32, a data-parallel NIXL prefill on CPU: now and then a rank whose prompt the decode
#: engine is pulling steps alone (it still holds the KV to send) and waits in the ranks'
#: lockstep for a rank that went idle, so the pull never ends (the decode engine logs
#: "KV fetch: 1 in progress", the rank's engine core "No available shared memory broadcast
#: block found in 60 seconds") until a request arrives and starts a wave for every rank. Seen
#: in about one clean-clone CI run in five at this module's first class, never alone in five
#: runs of the class; a stall is not the sidecar's (its legs are sent; the pull is the
#: engines'), and a request that answers after a nudge still proves its rank and its output.
NUDGE_AFTER_S = 20.0
NUDGE_RANK = 0
#: The nudge's own wait; a nudge that gets no answer is only reported (the request's wait
#: goes on to the client's 120 s, then fails with the logs).
NUDGE_TIMEOUT_S = 60.0
#: Twice in CI (2026-12-06) the stall came at the class's first request, where a nudge
#: straight to rank 0 got no answer either: the whole data-parallel engine waited. So before
#: its tests each class warms both ranks (one request through the sidecar naming each rank,
#: a KV transfer from each); a warm-up with no answer in this long restarts both engines (the
#: engines' first transfers, not the sidecar's legs) and warms again, once. A stalled prefill
#: rank can also answer first through the sidecar's own deadline (a 504 after the prefill
#: leg's 30 s, seen in CI at 19:07 UTC the same day): that is the same stall (the deadline is
#: PREFILL_DEADLINE_S since, so the warm-up's own wait ends first).
WARM_UP_S = 60.0
#: The sidecar's prefill deadline in these classes (`--prefill-timeout-s`): past the nudge
#: and the wave it starts, under the client's 120 s. With the default 30 s a clean-clone run
#: (2026-12-07 10:09 UTC, the Mooncake class) had the sidecar answer a stalled rank's request
#: 504 ten seconds after its nudge, before the wave could finish it, and the class's next
#: test failed with it (each test now counts only its own nudges).
PREFILL_DEADLINE_S = 100.0


@dataclass(frozen=True)
class RankedPair:
    prefill: Engine
    decode: Engine
    sidecar: Sidecar
    sidecar_dir: Path
    #: The requests that needed a nudge (``_nudge``), each one request more on NUDGE_RANK;
    #: each test counts its own (it clears the list first).
    nudges: list[str] = field(default_factory=list)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.prefill.port}"

    def served(self, rank: int) -> float:
        return metric_value(self.prefill.url, SUCCESS, engine=str(rank))


def _ranked_pair(group: EngineGroup, tmp: pytest.TempPathFactory, prefill: EngineSpec,
                 decode: EngineSpec, *sidecar_args: str) -> Iterator[RankedPair]:
    engines = group.start([prefill, decode])
    prefill_engine, decode_engine = engines[prefill.name], engines[decode.name]
    extra: tuple[str, ...] = ()
    if prefill_engine.mooncake_bootstrap_port is not None:
        extra = ("--mooncake-bootstrap-port", str(prefill_engine.mooncake_bootstrap_port))
    sidecar_dir = tmp.mktemp(prefill.name)
    running = sidecar_process(
        sidecar_dir, "--engine", "vllm", "--engine-url", decode_engine.url,
        "--prefill-data-parallel-size", "2", "--data-parallel-size", "1",
        "--prefill-timeout-s", str(PREFILL_DEADLINE_S), *sidecar_args, *extra,
    )
    for sidecar in running:
        _warm_up(group, sidecar, sidecar_dir, prefill.name, decode.name)
        # A restart made new Engine records: the pair takes the group's current ones.
        yield RankedPair(group.engines[prefill.name], group.engines[decode.name], sidecar,
                         sidecar_dir)


def _warm_up(group: EngineGroup, sidecar: Sidecar, sidecar_dir: Path, prefill: str,
             decode: str) -> None:
    """One request through ``sidecar`` prefilled on each rank; both engines restarted once if
    one has no answer in ``WARM_UP_S`` (see there); a second such warm-up fails with the
    logs."""
    for attempt in (1, 2):
        target = f"127.0.0.1:{group.engines[prefill].port}"
        stalled = [rank for rank in (0, 1)
                   if not _answers_in_time(sidecar, target, rank, f"warm-up {attempt}")]
        if not stalled:
            return
        if attempt == 2:
            sidecar_log = (sidecar_dir / "sidecar.log").read_text(errors="replace")
            pytest.fail(f"warm-up: rank(s) {stalled} gave no answer in {WARM_UP_S:.0f} s, "
                        f"after a restart too\n--- prefill engine (2 ranks):\n"
                        f"{group.engines[prefill].log_tail(60)}\n--- decode engine:\n"
                        f"{group.engines[decode].log_tail(60)}\n--- sidecar:\n"
                        f"{''.join(sidecar_log.splitlines(True)[-30:])}", pytrace=False)
        print(f"warm-up: rank(s) {stalled} gave no answer in {WARM_UP_S:.0f} s; "
              "restarting both engines")
        group.restart(decode, kill=True)
        group.restart(prefill, kill=True)
        wait_ready(sidecar)


def _answers_in_time(sidecar: Sidecar, target: str, rank: int, tag: str) -> bool:
    """Whether a request through ``sidecar`` prefilled on ``rank`` answers in ``WARM_UP_S``
    (an engine's answer: the sidecar's 504 says an engine did not answer within its deadline).
    One that does not is left to its client's timeout (the restart after it breaks its
    connections)."""
    pool = ThreadPoolExecutor(1)
    answer = pool.submit(through, sidecar, COMPLETIONS,
                         completion_body(block_prompt(f"{tag} rank {rank}")), target,
                         headers={"x-data-parallel-rank": str(rank)})
    try:
        answer.result(timeout=WARM_UP_S)  # any text, even none: it answered
        return True
    except TimeoutError:
        return False
    except urllib.error.HTTPError as error:
        if error.code != 504:
            raise
        print(f"{tag} rank {rank}: the sidecar's deadline answered (504: {error.read()!r})")
        return False
    finally:
        pool.shutdown(wait=False)


@pytest.fixture(scope="class")
def nixl_dp2(engine_env: EngineEnv, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[RankedPair]:
    # Rank r's NIXL side channel listens on the base port + r.
    side = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port_run(2))}
    with EngineGroup(engine_env) as group:
        yield from _ranked_pair(
            group, tmp_path_factory,
            EngineSpec("dp2-nixl-prefill", nixl_config("kv_producer"), cpu=0,
                       extra_args=DP2_ARGS, extra_env={**DP2_BIND, **side}),
            EngineSpec("nixl-decode", nixl_config("kv_consumer"), cpu=0, prefix_caching=False,
                       extra_env=UNPINNED),
            "--kv-connector", "shfs",
        )


@pytest.fixture(scope="class")
def mooncake_dp2(engine_env: EngineEnv, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[RankedPair]:
    if not engine_env.mooncake_ready:
        pytest.fail(f"Mooncake is not set up in {engine_env.root}: run "
                    "bash tests/real_vllm/setup_env.sh", pytrace=False)
    with EngineGroup(engine_env) as group:
        yield from _ranked_pair(
            group, tmp_path_factory,
            EngineSpec("dp2-mooncake-prefill",
                       mooncake_config("kv_producer", MOONCAKE_ENGINE_ID), cpu=0,
                       extra_args=DP2_ARGS, extra_env={**DP2_BIND, **MOONCAKE_ABORT}),
            EngineSpec("mooncake-decode", mooncake_config("kv_consumer"), cpu=0,
                       prefix_caching=False, extra_env={**UNPINNED, **MOONCAKE_ABORT}),
            "--kv-connector", "mooncake",
        )


def _through(pair: RankedPair, body: dict[str, Any], what: str,
             headers: dict[str, str] | None = None) -> str:
    """A completion through the pair's sidecar. One with no answer after ``NUDGE_AFTER_S``
    gets a nudge (vLLM's data-parallel stall below); one with none in the client's 120 s
    fails with the tails of both engines' logs and the sidecar's."""
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(through, pair.sidecar, COMPLETIONS, body, pair.target,
                             headers=headers)
        try:
            return answer.result(timeout=NUDGE_AFTER_S)
        except TimeoutError:  # no answer yet (the client's own timeout is 120 s)
            _nudge(pair, what)
        try:
            return answer.result()
        except TimeoutError:  # the client's
            sidecar_log = (pair.sidecar_dir / "sidecar.log").read_text(errors="replace")
            pytest.fail(f"{what}: no answer in 120 s, nudged\n--- prefill engine (2 ranks):\n"
                        f"{pair.prefill.log_tail(60)}\n--- decode engine:\n"
                        f"{pair.decode.log_tail(60)}\n--- sidecar:\n"
                        f"{''.join(sidecar_log.splitlines(True)[-30:])}", pytrace=False)


def _nudge(pair: RankedPair, what: str) -> None:
    """One token on prefill rank ``NUDGE_RANK``, straight to the engine: a request starts a
    data-parallel wave, in which the idle rank steps with the waiting one (vLLM 0.32; see
    ``NUDGE_AFTER_S``). Counted in ``pair.nudges`` for the per-rank tallies."""
    print(f"{what}: no answer after {NUDGE_AFTER_S:.0f} s; nudging rank {NUDGE_RANK}")
    request = urllib.request.Request(
        pair.prefill.url + COMPLETIONS,
        data=json.dumps(completion_body("nudge", 1)).encode(),
        headers={"Content-Type": "application/json", "x-data-parallel-rank": str(NUDGE_RANK)},
        method="POST")
    try:
        with urllib.request.urlopen(request, timeout=NUDGE_TIMEOUT_S) as response:
            response.read()
    except OSError as error:  # TimeoutError among them; the request's own wait decides
        print(f"{what}: the nudge got no answer ({error!r})")
        return
    pair.nudges.append(what)


def _spread_over_both_ranks(pair: RankedPair, tag: str) -> None:
    """REQUESTS requests through the sidecar, each equal to the decode's own computation; the
    prefill legs spread over both ranks, and the KV moved for every one."""
    pair.nudges.clear()  # this test's own: a failed test's nudges are not this one's
    before = [pair.served(0), pair.served(1)]
    legs_before = [_prefill_legs(pair, 0), _prefill_legs(pair, 1)]
    for i in range(REQUESTS):
        body = completion_body(block_prompt(f"{tag} {i}"))
        expected = text_of(post_json(pair.decode.url + COMPLETIONS, body))
        prompt_tokens = post_json(pair.decode.url + COMPLETIONS,
                                  {**body, "max_tokens": 1})["usage"]["prompt_tokens"]
        hits = metric_value(pair.decode.url, EXTERNAL_HITS)
        got = _through(pair, body, f"request {i}")
        assert expected
        assert got == expected, f"request {i}"
        # Without prefix caching on decode only the hand-off gives external hits.
        assert metric_value(pair.decode.url, EXTERNAL_HITS) - hits >= prompt_tokens - 1
    per_rank = [pair.served(rank) - before[rank] for rank in (0, 1)]
    nudged = len(pair.nudges)
    prefilled = [per_rank[rank] - (nudged if rank == NUDGE_RANK else 0) for rank in (0, 1)]
    if not nudged:
        # Sequential legs go round the ranks: half on each.
        assert prefilled == [REQUESTS / 2, REQUESTS / 2], _rank_report(pair, per_rank)
    else:
        # After a stall, each rank at least one leg, not exactly its half. A clean-clone run
        # (2026-12-07 11:35 UTC, the Mooncake class) had its first request answer after a
        # nudge, all four equal to the decode's output with their KV moved, and the engine
        # count [2, 3] with the nudge on rank 0. Why is not known: that run kept no sidecar
        # log, and the sidecar's rules give no leg on a single target another rank (a whole
        # move after a failed decode would count one more, not one fewer). The count after a
        # stall is the engines' wave's; a tally that is off now prints the sidecar's side.
        assert min(prefilled) >= 1, _rank_report(pair, per_rank)
    # The sidecar's own tally of its legs by rank agrees with the engine's.
    ok_legs = [_prefill_legs(pair, rank) - legs_before[rank] for rank in (0, 1)]
    assert ok_legs == prefilled or (nudged and min(ok_legs) >= 1), _rank_report(pair, per_rank)


def _prefill_legs(pair: RankedPair, rank: int, outcome: str = "ok") -> float:
    """The sidecar's prefill legs on ``rank`` that ended with ``outcome``, since it started."""
    return metric_value(pair.sidecar.url, RANK_LEGS, leg="prefill", rank=str(rank),
                        outcome=outcome)


def _rank_report(pair: RankedPair, per_rank: list[float]) -> str:
    """Why a per-rank tally differs: the engine's per rank, the nudges, the sidecar's legs by
    rank and outcome, and the tail of its log."""
    sidecar_legs = {(rank, outcome): _prefill_legs(pair, rank, outcome) for rank in (0, 1)
                    for outcome in ("ok", "failed", "connect_refused", "rejected")}
    sidecar_log = (pair.sidecar_dir / "sidecar.log").read_text(errors="replace")
    return (f"engine requests per rank {per_rank}, nudges {pair.nudges}, the sidecar's "
            f"prefill legs (rank, outcome) since start {sidecar_legs}\n--- sidecar:\n"
            f"{''.join(sidecar_log.splitlines(True)[-40:])}")


def _named_rank_prefills_there(pair: RankedPair, tag: str) -> None:
    pair.nudges.clear()
    before = [pair.served(0), pair.served(1)]
    body = completion_body(block_prompt(tag))
    expected = text_of(post_json(pair.decode.url + COMPLETIONS, body))
    for _ in range(2):
        got = _through(pair, body, "named rank 1", headers={"x-data-parallel-rank": "1"})
        assert got == expected
    per_rank = [pair.served(0) - before[0], pair.served(1) - before[1]]
    expected_per_rank = [0.0, 2.0]  # the router's rank, every time
    expected_per_rank[NUDGE_RANK] += len(pair.nudges)
    assert per_rank == expected_per_rank, _rank_report(pair, per_rank)


class TestNixl:
    def test_both_ranks_prefill_and_output_equals(self, nixl_dp2: RankedPair) -> None:
        _spread_over_both_ranks(nixl_dp2, "dp2 nixl")

    def test_the_routers_rank_prefills(self, nixl_dp2: RankedPair) -> None:
        _named_rank_prefills_there(nixl_dp2, "dp2 nixl named")


class TestMooncake:
    def test_query_lists_each_ranks_engine(self, mooncake_dp2: RankedPair) -> None:
        port = mooncake_dp2.prefill.mooncake_bootstrap_port
        answer = json.loads(get_text(f"http://127.0.0.1:{port}/query"))
        assert sorted(answer) == ["0", "1"]
        for rank in (0, 1):
            assert engine_id_from_query(answer, rank) == f"{MOONCAKE_ENGINE_ID}_dp{rank}"

    def test_both_ranks_prefill_and_output_equals(self, mooncake_dp2: RankedPair) -> None:
        _spread_over_both_ranks(mooncake_dp2, "dp2 mooncake")

    def test_the_routers_rank_prefills(self, mooncake_dp2: RankedPair) -> None:
        _named_rank_prefills_there(mooncake_dp2, "dp2 mooncake named")
