"""Per-request identifiers of the hand-offs: TRT-LLM disagg ids, SGLang rooms, Mooncake ids.

- ``SnowflakeIds``: the seed's TensorRT-LLM ``disagg_request_id``:
  ``[timestamp 41b][machine 10b][counter 12b]``, folded into ``[2**42, 2**63-1)`` so TRT-LLM
  treats it as a global (cross-worker) id. Thread-safe.
- ``RoomAllocator``: SGLang ``bootstrap_room``: random, non-negative, unique among the rooms
  in flight (a reused room can inherit a stale failure). ``INT32_ROOMS`` fits SGLang's gRPC.
- ``IdSources``: the bundle the orchestrator hands to handlers.

Workers (``--workers N``): each worker process draws from its own *lane* (its index of N) so
no two workers of one pod can produce the same id, while every worker keeps the configured
machine id (the pod's identity towards TRT-LLM):

- snowflake: the 12-bit counter runs ``lane, lane + N, lane + 2N, ...`` below
  ``N * (4096 // N)``, so ``counter % N`` is the lane: each worker has ``4096 // N`` ids per
  millisecond (one worker: 0..4095, exactly the seed's counter);
- rooms: ``room % N`` is the lane, in the int64 HTTP range and the int32 gRPC range alike, so
  one worker's gRPC rooms never meet another's HTTP rooms either.
"""

from __future__ import annotations

import secrets
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from sidecar.errors import ResourceExhausted

TRT_MACHINE_ID_BITS = 10
TRT_MIN_GLOBAL_ID = 1 << 42
TRT_MAX_MACHINE_ID = (1 << TRT_MACHINE_ID_BITS) - 1
#: 2023-01-01T00:00:00Z in milliseconds: the snowflake epoch.
TRT_EPOCH_MS = 1_672_531_200_000
_TIMESTAMP_MAX = (1 << 41) - 1
_COUNTER_MASK = 0xFFF
_FOLD_MODULUS = (1 << 63) - 1 - TRT_MIN_GLOBAL_ID

INT64_ROOMS = (1 << 63) - 1
INT32_ROOMS = (1 << 31) - 1


def validate_trt_machine_id(machine_id: int) -> None:
    """Raise ``ValueError`` unless ``machine_id`` fits the snowflake's 10-bit field."""
    if not 0 <= machine_id <= TRT_MAX_MACHINE_ID:
        raise ValueError(f"TRT-LLM machine id {machine_id} is outside 0..{TRT_MAX_MACHINE_ID}")


def snowflake_id(now_ms: int, machine_id: int, counter: int) -> int:
    """The disagg request id for one instant, machine and counter value (pure)."""
    timestamp = min(max(now_ms - TRT_EPOCH_MS, 0), _TIMESTAMP_MAX)
    raw = (timestamp << 22) | (machine_id << 12) | (counter & _COUNTER_MASK)
    return raw % _FOLD_MODULUS + TRT_MIN_GLOBAL_ID


def _check_lane(lane: int, lanes: int, most: int) -> None:
    if not 1 <= lanes <= most:
        raise ValueError(f"lanes {lanes} is outside 1..{most}")
    if not 0 <= lane < lanes:
        raise ValueError(f"lane {lane} is outside 0..{lanes - 1}")


class SnowflakeIds:
    """Generates TRT-LLM disagg request ids for one machine id (and one worker's lane)."""

    def __init__(
        self,
        machine_id: int,
        clock_ms: Callable[[], int] | None = None,
        *,
        lane: int = 0,
        lanes: int = 1,
    ) -> None:
        validate_trt_machine_id(machine_id)
        _check_lane(lane, lanes, _COUNTER_MASK + 1)
        self._machine_id = machine_id
        self._clock_ms = clock_ms or (lambda: time.time_ns() // 1_000_000)
        self._lane = lane
        self._lanes = lanes
        #: How many counter values this lane owns: lane + lanes * step, step < _steps.
        self._steps = (_COUNTER_MASK + 1) // lanes
        self._step = 0
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            step = self._step
            self._step = (step + 1) % self._steps
        counter = self._lane + self._lanes * step
        return snowflake_id(self._clock_ms(), self._machine_id, counter)


class RoomAllocator:
    """Random SGLang bootstrap rooms in ``[0, max_room]``, unique among those in flight.

    ``lane`` of ``lanes``: only rooms with ``room % lanes == lane`` (one worker's share).
    """

    def __init__(self, max_room: int = INT64_ROOMS, *, lane: int = 0, lanes: int = 1) -> None:
        if max_room < 1:
            raise ValueError("max_room must be positive")
        _check_lane(lane, lanes, max_room)
        self._max_room = max_room
        self._lane = lane
        self._lanes = lanes
        #: Rooms of this lane: lane + lanes * k for k < _capacity.
        self._capacity = (max_room - lane) // lanes + 1
        self._in_flight: set[int] = set()
        self._lock = threading.Lock()

    def narrowed(self, max_room: int) -> RoomAllocator:
        """An allocator over ``[0, max_room]`` sharing this one's rooms in flight.

        gRPC paths need int32 rooms; sharing the in-flight set keeps them unique against the
        HTTP path's int64 rooms on the same prefill engine.
        """
        view = RoomAllocator(min(max_room, self._max_room), lane=self._lane, lanes=self._lanes)
        view._in_flight = self._in_flight
        view._lock = self._lock
        return view

    @property
    def max_room(self) -> int:
        return self._max_room

    def allocate(self) -> int:
        with self._lock:
            if len(self._in_flight) >= self._capacity:
                raise ResourceExhausted("every SGLang bootstrap room is in flight")
            while True:
                room = self._lane + self._lanes * secrets.randbelow(self._capacity)
                if room not in self._in_flight:
                    self._in_flight.add(room)
                    return room

    def release(self, room: int) -> None:
        with self._lock:
            self._in_flight.discard(room)

    def in_flight(self) -> int:
        return len(self._in_flight)


def new_transfer_id() -> str:
    """A Mooncake ``transfer_id``: one per request, chosen by the router."""
    return f"xfer-{uuid.uuid4().hex}"


@dataclass
class IdSources:
    """The id generators one sidecar process shares across requests."""

    snowflake: SnowflakeIds
    rooms: RoomAllocator
    transfer_id: Callable[[], str] = field(default=new_transfer_id)
