"""Fault switches: what a stub does wrong, on which path, for how many requests.

A ``Fault`` names one misbehaviour; the ``FaultBook`` holds the active ones (set at
construction, at runtime through the Python object, or over HTTP at ``/_stub/faults``) and
hands each engine request the first fault that matches its path, counting down ``times``.

    kind            what the client sees
    status          an engine-like error body with ``status``
    delay           nothing for ``delay_s``, then the normal answer
    hang            nothing, ever (until the client goes away)
    truncate        JSON cut in the middle (stream: the last event cut, no [DONE])
    malformed       not JSON (stream: an event whose data is not JSON)
    drop            the connection closed after ``after_chunks`` SSE events (JSON: no response)
    stall           headers (and ``after_chunks`` events), then silence
    linger          the whole answer (a stream: ``[DONE]`` too), then its end withheld: the
                    connection held open until the client goes away
    content_type    the normal body labelled ``text/html``
    oversized       a valid body padded to ``size`` bytes (stream: one huge event)
    no_handoff      a prefill answer without its hand-off (vLLM NIXL: params null; Mooncake:
                    no push; SGLang: answers without meeting its decode; TRT-LLM: no
                    disaggregated_params; Neuron: no effect, the answer is the hand-off)

Deliberate limits: one fault per request (the first match); ``path`` None matches the
engine's inference paths only (never ``/health``, ``/metrics`` or ``/_stub/*``).
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from typing import Any


class FaultKind(StrEnum):
    STATUS = "status"
    DELAY = "delay"
    HANG = "hang"
    TRUNCATE = "truncate"
    MALFORMED = "malformed"
    DROP = "drop"
    STALL = "stall"
    CONTENT_TYPE = "content_type"
    OVERSIZED = "oversized"
    NO_HANDOFF = "no_handoff"
    #: A stream that fails after its head the way vLLM and SGLang end one: an error event,
    #: then ``data: [DONE]`` (streams only; ``after_chunks`` events first).
    ERROR_EVENT = "error_event"
    #: The whole stream, then its chunked end withheld (streams only): the reader has every
    #: event while the exchange has not ended.
    LINGER = "linger"


@dataclass(frozen=True)
class Fault:
    """One misbehaviour. ``times`` None: until cleared; N: the next N matching requests."""

    kind: FaultKind
    path: str | None = None
    times: int | None = None
    status: int = 500
    message: str = "stub fault"
    delay_s: float = 0.0
    after_chunks: int = 0
    size: int = 1 << 20

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", FaultKind(self.kind))
        if self.times is not None and self.times < 1:
            raise ValueError("times must be >= 1 (or None for 'until cleared')")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Fault:
        if not isinstance(data, dict) or "kind" not in data:
            raise ValueError("a fault is an object with at least 'kind'")
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown fault fields: {sorted(unknown)}")
        return cls(**data)


class FaultBook:
    """The active faults of one stub (single event loop: no locking needed)."""

    def __init__(self, faults: tuple[Fault, ...] | list[Fault] = ()) -> None:
        self._faults: list[Fault] = list(faults)
        self.fired = 0
        self._hang_release = asyncio.Event()

    def set(self, fault: Fault) -> Fault:
        """Add a fault (after those already set); returns it."""
        self._faults.append(fault)
        return fault

    def add(self, kind: FaultKind | str, **kwargs: Any) -> Fault:
        """Shorthand: ``stub.faults.add("status", status=503, times=1)``."""
        return self.set(Fault(kind=FaultKind(kind), **kwargs))

    def clear(self) -> None:
        self._faults.clear()

    def active(self) -> list[Fault]:
        return list(self._faults)

    def take(self, path: str, *, inference: bool) -> Fault | None:
        """The fault for this request, if any, consuming one of its ``times``."""
        for i, fault in enumerate(self._faults):
            if fault.path is None and not inference:
                continue
            if fault.path is not None and fault.path != path:
                continue
            if fault.times is not None:
                if fault.times <= 1:
                    del self._faults[i]
                else:
                    self._faults[i] = replace(fault, times=fault.times - 1)
            self.fired += 1
            return fault
        return None

    async def hang(self) -> None:
        """Wait until the client goes away (the handler is cancelled) or the stub stops."""
        await self._hang_release.wait()

    def release_hangs(self) -> None:
        """Let every hanging handler finish (used at shutdown)."""
        self._hang_release.set()
