"""Proves the parts of ``--workers`` on their own, without processes:

- id lanes: each worker's snowflake counters and SGLang rooms (int64 and the int32 gRPC view)
  lie in its own lane, so two workers drawing in the same millisecond never collide; one
  lane is the plain counter of docs/driving/handoffs.md#trtllm-snowflake exactly;
- the pool-wide in-flight bound over the shared slot file, and a dead worker's slot cleared;
- ``--workers auto`` from the CPU affinity and the cgroup quota (v1 and v2 files), and the
  setting's range;
- the staging sweep: a pooled worker keeps its own entries fresh, so worker 0's sweep leaves
  them; the restart backoff doubles, is bounded and resets.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from sidecar.config.cores import (
    WORKER_BYTES,
    auto_workers,
    available_cores,
    cgroup_cpu_limit,
    cgroup_memory_limit,
)
from sidecar.config.loader import add_settings_arguments, load_settings
from sidecar.config.settings import Settings
from sidecar.dialects.sglang import INT32_ROOMS, RoomAllocator
from sidecar.dialects.trtllm import SnowflakeIds
from sidecar.errors import Overloaded, ResourceExhausted
from sidecar.grpc_server.inline.orphans import sweep_orphans, touch_owned
from sidecar.request.scope import Admission
from sidecar.workers.identity import MAX_WORKERS, WorkerIdentity
from sidecar.workers.shared_inflight import InflightSlots
from sidecar.workers.supervisor import Backoff, describe_exit

FROZEN_MS = 1_767_225_600_000


def _counter(snowflake: int) -> int:
    return (snowflake - (1 << 42)) & 0xFFF


@pytest.mark.parametrize("lanes", [2, 3, 64])
def test_snowflake_lanes_never_meet_within_one_millisecond(lanes: int) -> None:
    generators = [SnowflakeIds(7, lambda: FROZEN_MS, lane=lane, lanes=lanes)
                  for lane in range(lanes)]
    per_lane = 4096 // lanes
    ids = [g.next() for g in generators for _ in range(per_lane)]
    assert len(set(ids)) == lanes * per_lane  # one millisecond, every lane's whole share
    for lane, generator in enumerate(generators):
        counters = [_counter(generator.next()) for _ in range(per_lane)]
        assert {c % lanes for c in counters} == {lane}
        assert max(counters) < 4096


def test_one_lane_is_the_seed_counter() -> None:
    ids = SnowflakeIds(0, lambda: FROZEN_MS, lane=0, lanes=1)
    assert [_counter(ids.next()) for _ in range(4097)] == [*range(4096), 0]


def test_a_lane_wraps_within_itself() -> None:
    ids = SnowflakeIds(0, lambda: FROZEN_MS, lane=1, lanes=3)
    counters = [_counter(ids.next()) for _ in range(4096 // 3 + 1)]
    assert counters[0] == 1 and counters[-2] == 1 + 3 * (4096 // 3 - 1) and counters[-1] == 1


@pytest.mark.parametrize(("lane", "lanes"), [(2, 2), (-1, 2), (0, 0), (0, 4097)])
def test_invalid_snowflake_lane(lane: int, lanes: int) -> None:
    with pytest.raises(ValueError, match="lane"):
        SnowflakeIds(0, lane=lane, lanes=lanes)


def test_room_lanes_hold_only_their_residue_and_exhaust_cleanly() -> None:
    rooms = RoomAllocator(99, lane=1, lanes=4)
    drawn = [rooms.allocate() for _ in range(25)]
    assert sorted(drawn) == list(range(1, 100, 4))
    with pytest.raises(ResourceExhausted):
        rooms.allocate()


def test_int32_view_keeps_the_lane_and_the_shared_in_flight_set() -> None:
    wide = RoomAllocator(lane=1, lanes=2)
    narrow = wide.narrowed(INT32_ROOMS)
    drawn = [narrow.allocate() for _ in range(200)] + [wide.allocate() for _ in range(200)]
    assert all(room % 2 == 1 for room in drawn)
    assert all(room <= INT32_ROOMS for room in drawn[:200])
    assert wide.in_flight() == narrow.in_flight() == 400


def test_inflight_bound_is_the_pool_s(tmp_path: Path) -> None:
    path = tmp_path / "inflight.slots"
    InflightSlots.create(path, 2)
    first = Admission(3, InflightSlots.open(path, 2, 0))
    second = Admission(3, InflightSlots.open(path, 2, 1))
    first.enter()
    first.enter()
    second.enter()
    with pytest.raises(Overloaded):
        second.enter()  # it holds one itself, the pool three
    with pytest.raises(Overloaded):
        first.enter()
    first.leave()
    second.enter()
    assert second.inflight == 2
    # Worker 0 dies holding one and restarts: its slot starts empty.
    restarted_slots = InflightSlots.open(path, 2, 0)
    assert restarted_slots.total() == 2
    # Worker 1 dies holding two: the supervisor clears its slot; the pool is empty again.
    InflightSlots.clear(path, 1)
    restarted = Admission(3, restarted_slots)
    for _ in range(3):
        restarted.enter()
    with pytest.raises(Overloaded):
        restarted.enter()


def test_inflight_slots_refuse_a_file_of_another_size(tmp_path: Path) -> None:
    path = tmp_path / "inflight.slots"
    InflightSlots.create(path, 3)
    with pytest.raises(ValueError, match="slots"):
        InflightSlots.open(path, 2, 0)
    with pytest.raises(ValueError, match="slot 3"):
        InflightSlots.open(path, 3, 3)


@pytest.mark.parametrize(
    ("files", "limit"),
    [
        ({"cpu.max": "150000 100000\n"}, 2),
        ({"cpu.max": "100000 100000\n"}, 1),
        ({"cpu.max": "50000 100000\n"}, 1),
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "garbage\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),
    ],
)
def test_cgroup_cpu_limit(tmp_path: Path, files: dict[str, str], limit: int | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_limit(tmp_path) == limit


def test_available_cores_is_the_smaller_of_affinity_and_quota(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    assert available_cores(tmp_path) == affinity
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    assert available_cores(tmp_path) == 1


@pytest.mark.parametrize(
    ("files", "limit"),
    [
        ({"memory.max": "1073741824\n"}, 1 << 30),
        ({"memory.max": "max\n"}, None),
        ({"memory.max": "garbage\n"}, None),
        ({"memory/memory.limit_in_bytes": "536870912\n"}, 1 << 29),
        ({"memory/memory.limit_in_bytes": "9223372036854771712\n"}, None),
        ({}, None),
    ],
)
def test_cgroup_memory_limit(tmp_path: Path, files: dict[str, str], limit: int | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_memory_limit(tmp_path) == limit


def test_auto_workers_are_as_many_as_the_memory_limit_holds(tmp_path: Path) -> None:
    """A container without a CPU limit on a many-core node gets the workers its memory holds;
    with room for more, the cores decide; never none."""
    (tmp_path / "cpu.max").write_text("6400000 100000\n")  # 64 cores' quota
    cores = available_cores(tmp_path)
    (tmp_path / "memory.max").write_text(f"{1 << 30}\n")  # deploy/'s 1 GiB
    assert auto_workers(tmp_path) == min(cores, 10)
    (tmp_path / "memory.max").write_text(f"{WORKER_BYTES}\n")
    assert auto_workers(tmp_path) == 1
    (tmp_path / "memory.max").write_text("max\n")
    assert auto_workers(tmp_path) == cores


def test_auto_is_one_worker_where_one_process_holds_the_kv_event_index() -> None:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    loaded = load_settings(parser.parse_args(
        ["--kv-events-endpoint", "tcp://127.0.0.1:5557", "--engine", "vllm"]),
        {"DISAGG_WORKERS": "auto"})
    assert loaded.settings.workers == 1


def test_workers_setting_auto_and_range() -> None:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    loaded = load_settings(parser.parse_args(["--workers", "auto"]), {})
    assert loaded.settings.workers == min(auto_workers(), MAX_WORKERS)
    assert loaded.sources["workers"] == "flag --workers"
    assert load_settings(parser.parse_args([]), {"DISAGG_WORKERS": "3"}).settings.workers == 3
    assert Settings().workers == 1
    for bad in (0, MAX_WORKERS + 1, "some"):
        with pytest.raises(ValidationError):
            Settings(workers=bad)


def test_worker_identity_is_checked(tmp_path: Path) -> None:
    assert not WorkerIdentity().pooled and WorkerIdentity().runs_pod_chores
    assert WorkerIdentity(1, 2, tmp_path).pooled
    assert not WorkerIdentity(1, 2, tmp_path).runs_pod_chores
    for index, count, run_dir in ((2, 2, tmp_path), (0, 0, tmp_path), (0, 2, None)):
        with pytest.raises(ValueError):
            WorkerIdentity(index, count, run_dir)


def test_owned_entries_kept_fresh_survive_another_worker_s_sweep(tmp_path: Path) -> None:
    owned, other = "d-" + "1" * 32, "p-" + "2" * 32
    for key in (owned, other):
        (tmp_path / key).mkdir()
    (tmp_path / f".{owned}.notify").write_bytes(b"")
    an_hour_ago = time.time() - 3600
    for name in (owned, other, f".{owned}.notify"):
        os.utime(tmp_path / name, (an_hour_ago, an_hour_ago))
    assert touch_owned(tmp_path, {owned, "d-" + "3" * 32}) == 2  # a missing one is skipped
    # Worker 0 sweeps without knowing what the touching worker owns.
    assert sweep_orphans(tmp_path, set(), older_than_s=90) == [other]
    assert (tmp_path / owned).is_dir() and (tmp_path / f".{owned}.notify").exists()


def test_restart_backoff_doubles_up_to_a_bound_and_resets() -> None:
    backoff = Backoff(first_s=0.2, most_s=1.0)
    assert [backoff.next() for _ in range(5)] == [0.2, 0.4, 0.8, 1.0, 1.0]
    backoff.reset()
    assert backoff.next() == 0.2


def test_exit_descriptions() -> None:
    assert describe_exit(-9) == "signal SIGKILL"
    assert describe_exit(3) == "exit code 3"
