"""Per-request identifiers of the hand-offs: TRT-LLM disagg ids, SGLang rooms, Mooncake ids.

- ``SnowflakeIds``: the seed's TensorRT-LLM ``disagg_request_id``:
  ``[timestamp 41b][machine 10b][counter 12b]``, folded into ``[2**42, 2**63-1)`` so TRT-LLM
  treats it as a global (cross-worker) id. Thread-safe.
- ``RoomAllocator``: SGLang ``bootstrap_room``: random, non-negative, unique among the rooms
  in flight (a reused room can inherit a stale failure). ``INT32_ROOMS`` fits SGLang's gRPC.
- ``IdSources``: the bundle the orchestrator hands to handlers.
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


class SnowflakeIds:
    """Generates TRT-LLM disagg request ids for one machine id."""

    def __init__(self, machine_id: int, clock_ms: Callable[[], int] | None = None) -> None:
        validate_trt_machine_id(machine_id)
        self._machine_id = machine_id
        self._clock_ms = clock_ms or (lambda: time.time_ns() // 1_000_000)
        self._counter = 0
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            counter = self._counter
            self._counter = (counter + 1) & _COUNTER_MASK
        return snowflake_id(self._clock_ms(), self._machine_id, counter)


class RoomAllocator:
    """Random SGLang bootstrap rooms in ``[0, max_room]``, unique among those in flight."""

    def __init__(self, max_room: int = INT64_ROOMS) -> None:
        if max_room < 1:
            raise ValueError("max_room must be positive")
        self._max_room = max_room
        self._in_flight: set[int] = set()
        self._lock = threading.Lock()

    def narrowed(self, max_room: int) -> RoomAllocator:
        """An allocator over ``[0, max_room]`` sharing this one's rooms in flight.

        gRPC paths need int32 rooms; sharing the in-flight set keeps them unique against the
        HTTP path's int64 rooms on the same prefill engine.
        """
        view = RoomAllocator(min(max_room, self._max_room))
        view._in_flight = self._in_flight
        view._lock = self._lock
        return view

    @property
    def max_room(self) -> int:
        return self._max_room

    def allocate(self) -> int:
        with self._lock:
            if len(self._in_flight) > self._max_room:
                raise ResourceExhausted("every SGLang bootstrap room is in flight")
            while True:
                room = secrets.randbelow(self._max_room + 1)
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
