"""Proves the dialects' per-request id sources: TRT-LLM snowflakes, SGLang rooms, Mooncake
transfer ids.

Snowflake vectors from docs/driving/handoffs.md#trtllm-snowflake, the clamping and counter wrap,
thread safety (many threads, all ids unique) and machine-id validation; rooms non-negative,
within the configured range (int32 option), unique among those in flight and reusable once
released.
"""

from __future__ import annotations

import threading

import pytest

from sidecar.dialects.sglang import INT32_ROOMS, INT64_ROOMS, RoomAllocator
from sidecar.dialects.trtllm import (
    TRT_EPOCH_MS,
    TRT_MIN_GLOBAL_ID,
    SnowflakeIds,
    snowflake_id,
    validate_trt_machine_id,
)
from sidecar.dialects.vllm_mooncake import new_transfer_id

NEW_YEAR_2026_MS = 1_767_225_600_000


@pytest.mark.parametrize(
    ("now_ms", "machine", "counter", "expected"),
    [
        (TRT_EPOCH_MS, 0, 0, 4398046511104),
        (NEW_YEAR_2026_MS, 0, 0, 397181498744111104),
        (NEW_YEAR_2026_MS, 1, 5, 397181498744115205),
    ],
)
def test_contract_vectors(now_ms: int, machine: int, counter: int, expected: int) -> None:
    assert snowflake_id(now_ms, machine, counter) == expected


def test_generator_reproduces_the_vectors() -> None:
    gen = SnowflakeIds(1, clock_ms=lambda: NEW_YEAR_2026_MS)
    ids = [gen.next() for _ in range(6)]
    assert ids[0] == 397181498744115200
    assert ids[5] == 397181498744115205


def test_clock_before_epoch_clamps_to_zero_and_minimum() -> None:
    assert snowflake_id(0, 0, 0) == TRT_MIN_GLOBAL_ID


def test_every_id_is_in_the_global_range() -> None:
    for now in (TRT_EPOCH_MS, NEW_YEAR_2026_MS, TRT_EPOCH_MS + (1 << 41) + 5, 2**62):
        for machine in (0, 1023):
            value = snowflake_id(now, machine, 4095)
            assert TRT_MIN_GLOBAL_ID <= value < 2**63 - 1


def test_counter_wraps_at_12_bits() -> None:
    gen = SnowflakeIds(0, clock_ms=lambda: NEW_YEAR_2026_MS)
    first = gen.next()
    for _ in range(4095):
        gen.next()
    assert gen.next() == first


@pytest.mark.parametrize("machine", [-1, 1024, 10_000])
def test_machine_id_out_of_range_is_refused(machine: int) -> None:
    with pytest.raises(ValueError, match="machine id"):
        validate_trt_machine_id(machine)
    with pytest.raises(ValueError):
        SnowflakeIds(machine)


@pytest.mark.parametrize("machine", [0, 1023])
def test_machine_id_bounds_are_accepted(machine: int) -> None:
    validate_trt_machine_id(machine)
    assert SnowflakeIds(machine).next() >= TRT_MIN_GLOBAL_ID


def test_thread_safety_all_ids_unique() -> None:
    # A frozen clock makes uniqueness rest on the counter alone: 16 x 256 = 4096 ids.
    gen = SnowflakeIds(7, clock_ms=lambda: NEW_YEAR_2026_MS)
    results: list[list[int]] = [[] for _ in range(16)]
    start = threading.Barrier(16)

    def work(slot: list[int]) -> None:
        start.wait()
        slot.extend(gen.next() for _ in range(256))

    threads = [threading.Thread(target=work, args=(slot,)) for slot in results]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = [value for slot in results for value in slot]
    assert len(every) == 4096
    assert len(set(every)) == 4096


def test_rooms_int32_range_and_unique_in_flight() -> None:
    rooms = RoomAllocator(INT32_ROOMS)
    allocated = [rooms.allocate() for _ in range(2000)]
    assert len(set(allocated)) == 2000
    assert all(0 <= room <= 2**31 - 1 for room in allocated)
    assert rooms.in_flight() == 2000
    for room in allocated:
        rooms.release(room)
    assert rooms.in_flight() == 0


def test_rooms_default_is_int64() -> None:
    assert RoomAllocator().max_room == INT64_ROOMS == 2**63 - 1


def test_rooms_exhaust_a_small_space_without_repeats() -> None:
    rooms = RoomAllocator(15)
    taken = {rooms.allocate() for _ in range(16)}
    assert taken == set(range(16))
    rooms.release(9)
    assert rooms.allocate() == 9  # the only free room


def test_rooms_unique_across_threads() -> None:
    rooms = RoomAllocator(4095)
    results: list[list[int]] = [[] for _ in range(8)]

    def work(slot: list[int]) -> None:
        slot.extend(rooms.allocate() for _ in range(256))

    threads = [threading.Thread(target=work, args=(slot,)) for slot in results]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = [room for slot in results for room in slot]
    assert len(set(every)) == 2048


def test_rooms_invalid_range() -> None:
    with pytest.raises(ValueError):
        RoomAllocator(0)


def test_transfer_ids_are_unique_and_prefixed() -> None:
    values = {new_transfer_id() for _ in range(1000)}
    assert len(values) == 1000
    assert all(value.startswith("xfer-") for value in values)
