"""Proves that ``serve --workers 2`` is one sidecar on one set of ports:

- both worker processes accept connections on the same HTTP port and serve PD requests (and
  name themselves in their log lines);
- ``/metrics``, from whichever worker answers, adds up every worker's counters, histograms and
  gauges, with the same metric names and labels as one process (``--workers 1``);
- identifiers stay unique across the workers under concurrent requests, as the stub engines
  receive them: TensorRT-LLM ``disagg_request_id`` (same machine id in both workers) and
  SGLang ``bootstrap_room``; each worker's ids lie in its own lane.
"""

from __future__ import annotations

from typing import Any

from pool_builders import (
    fresh_session,
    gather_limited,
    pd_settings,
    post_pd,
    running_pool,
    sample_sum,
    stubs,
)
from prometheus_client.parser import text_string_to_metric_families

from sidecar.dialects.trtllm import TRT_MIN_GLOBAL_ID


async def test_both_workers_serve_and_metrics_add_up() -> None:
    async with stubs("vllm") as (prefill, decode), running_pool(
        **pd_settings("vllm", "shfs", prefill, decode)
    ) as pool, fresh_session() as session:
        replies = await gather_limited(post_pd(session, pool, prefill) for _ in range(40))
        assert [status for status, _ in replies] == [200] * 40

        per_worker = [pool.worker_metric(pid, "disagg_requests_total", outcome="ok")
                      for pid in pool.pids.values()]
        assert len(per_worker) == 2 and all(n > 0 for n in per_worker), per_worker
        assert sum(per_worker) == 40
        for index in (0, 1):  # each worker names itself in its log lines
            assert pool.count(f"worker={index} sidecar.serve: listening:") == 1
        for _ in range(4):  # each scrape is a fresh connection: any worker may answer
            text = await pool.scrape()
            assert sample_sum(text, "disagg_requests_total", outcome="ok") == 40
            assert sample_sum(text, "disagg_stage_seconds_count", stage="total") == 40
            assert sample_sum(text, "disagg_inflight_requests") == 0
            assert sample_sum(text, "disagg_engine_ready") == 1
        assert await pool.stop() == 0


def _shape(text: str) -> set[tuple[str, str, tuple[str, ...]]]:
    """Every (family type, sample name, label names), without the ``_created`` samples."""
    return {
        (family.type, sample.name, tuple(sorted(sample.labels)))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


async def test_metric_names_and_labels_match_one_process() -> None:
    shapes = []
    async with stubs("vllm") as (prefill, decode):
        for workers in (1, 2):
            async with running_pool(
                workers=workers, **pd_settings("vllm", "shfs", prefill, decode)
            ) as pool, fresh_session() as session:
                for _ in range(4):
                    status, _ = await post_pd(session, pool, prefill)
                    assert status == 200
                shapes.append(_shape(await pool.scrape()))
                assert await pool.stop() == 0
    assert shapes[0] == shapes[1]
    assert ("counter", "disagg_requests_total",
            ("connector", "engine", "front_door", "outcome", "route")) in shapes[1]


async def _prefill_bodies(engine: str, requests: int) -> tuple[list[dict[str, Any]], list[float]]:
    """PD requests through two workers; the prefill bodies received and each worker's share
    (requests served by worker 0, by worker 1)."""
    async with stubs(engine) as (prefill, decode), running_pool(
        **pd_settings(engine, "shfs", prefill, decode)
    ) as pool, fresh_session() as session:
        # Concurrent on purpose: both workers draw ids in the same milliseconds.
        replies = await gather_limited(
            (post_pd(session, pool, prefill) for _ in range(requests)), limit=32
        )
        assert [status for status, _ in replies] == [200] * requests
        bodies = [entry.json for entry in prefill.recorder.on_path("/v1/completions")]
        shares = [pool.worker_metric(pool.pids[index], "disagg_requests_total", outcome="ok")
                  for index in (0, 1)]
        assert await pool.stop() == 0
    assert len(bodies) == requests
    assert len(shares) == 2 and all(n > 0 for n in shares), shares
    return bodies, shares


async def test_trtllm_request_ids_are_unique_across_workers() -> None:
    bodies, shares = await _prefill_bodies("trtllm", 64)
    ids = [body["disaggregated_params"]["disagg_request_id"] for body in bodies]
    assert len(set(ids)) == len(ids)
    assert all(i >= TRT_MIN_GLOBAL_ID for i in ids)
    # The snowflake's fields (the fold leaves today's ids at raw + 2^42): one machine id in
    # both workers, and 64 distinct counters, so no two ids can collide even within one
    # millisecond (two workers counting alike would both use counters 0, 1, ...). The
    # counter's lowest bit is the worker's lane: worker 0's ids are the even ones.
    raw = [i - TRT_MIN_GLOBAL_ID for i in ids]
    assert {r >> 12 & 0x3FF for r in raw} == {0}
    counters = [r & 0xFFF for r in raw]
    assert len(set(counters)) == len(counters)
    assert [sum(c % 2 == lane for c in counters) for lane in (0, 1)] == shares


async def test_sglang_rooms_are_unique_across_workers() -> None:
    bodies, shares = await _prefill_bodies("sglang", 64)
    rooms = [body["bootstrap_room"] for body in bodies]
    assert len(set(rooms)) == len(rooms)
    # Each worker's rooms lie in its own lane (room % 2), never in the other's.
    assert [sum(room % 2 == lane for room in rooms) for lane in (0, 1)] == shares
