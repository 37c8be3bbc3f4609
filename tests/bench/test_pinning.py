"""Proves the scaling bench's core split (``bench.pinning``): sidecars and bench on separate
halves, each worker count on as many cores as workers, the ones that do not fit named with a
reason. Does not prove the kernel honours the affinity (taskset does)."""

from __future__ import annotations

from bench.pinning import WorkerPinning, plan_pinning


def test_eight_cores_fit_up_to_four_workers_beside_the_bench() -> None:
    plan = plan_pinning((1, 2, 4, 8), cores=tuple(range(8)))
    assert plan.bench == (4, 5, 6, 7)
    assert plan.sidecars == {1: (0,), 2: (0, 1), 4: (0, 1, 2, 3)}
    assert set(plan.left_out) == {8} and "this machine has 8" in plan.left_out[8]
    assert plan.anchors == (0, 1, 2, 3)
    assert WorkerPinning.cpu_list(plan.sidecars[4]) == "0,1,2,3"


def test_two_cores_run_one_worker_pinned() -> None:
    plan = plan_pinning((1, 2), cores=(0, 1))
    assert plan.sidecars == {1: (0,)} and plan.bench == (1,)
    assert set(plan.left_out) == {2}


def test_one_core_runs_nothing_pinned() -> None:
    plan = plan_pinning((1,), cores=(3,))
    assert plan.sidecars == {} and set(plan.left_out) == {1}
