"""Checks on the gRPC contract's request messages before anything is sent to an engine.

    PreFillRequest / DecodeRequest ─check_*()─▶ plain values | InvalidRequest (INVALID_ARGUMENT)

The rules, and why Prefill lets ``max_new_tokens`` 0 pass: docs/driving/grpc-contract.md#checks (the
request
id: ``sidecar.protocol.request``; metadata ``x-data-parallel-rank``: the local engine's
rank the router placed the leg on, ``sidecar.targets.ranks.rank_from_metadata``).
Deliberate limits: no check against the engine's context length (the engine refuses, and
its 4xx maps to INVALID_ARGUMENT).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Final

from sidecar.errors import InvalidRequest

#: Upper bound of ``max_new_tokens``: far above any engine's context, below int32's end.
MAX_NEW_TOKENS: Final = 1 << 20


def check_token_ids(token_ids: Sequence[int]) -> list[int]:
    if not token_ids:
        raise InvalidRequest("token_ids must not be empty")
    ids = list(token_ids)
    if min(ids) < 0:
        raise InvalidRequest("token_ids must be non-negative")
    return ids


def check_max_new_tokens(value: int, *, allow_unset: bool) -> int:
    """``value`` when in range; 0 passes only with ``allow_unset`` (Prefill)."""
    if value == 0 and allow_unset:
        return value
    if not 1 <= value <= MAX_NEW_TOKENS:
        raise InvalidRequest(f"max_new_tokens must be in 1..{MAX_NEW_TOKENS}, got {value}")
    return value


def _float32(value: float) -> float:
    try:
        return float(struct.unpack("<f", struct.pack("<f", value))[0])
    except OverflowError:
        # A shortened decimal of a value near float32's maximum can round past it.
        return math.inf


def check_temperature(value: float) -> float:
    """The temperature as the shortest decimal with the same float32 value."""
    if not math.isfinite(value) or value < 0:
        raise InvalidRequest("temperature must be a finite number >= 0")
    for digits in range(1, 10):
        candidate = float(f"{value:.{digits}g}")
        if _float32(candidate) == value:
            return candidate
    return value
