"""What the PD flow takes in and hands out: a request, a prefill's hand-off, its counters."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sidecar.observability.tracing import NOOP_TRACE, RequestTrace
from sidecar.protocol.context import FrontDoor, PrefillTarget, Route
from sidecar.request.scope import Timings


@dataclass(frozen=True, slots=True)
class PDRequest:
    """One client request that runs as a prefill/decode pair."""

    route: Route
    body: Mapping[str, Any]
    stream: bool
    target: PrefillTarget
    request_id: str
    headers: Mapping[str, str]
    #: Every target the request may use (``target`` among them), for a refused prefill's retry.
    candidates: tuple[PrefillTarget, ...] = ()
    trace: RequestTrace = NOOP_TRACE
    front_door: FrontDoor = FrontDoor.HTTP
    #: The prefill leg's data-parallel rank as the router named it (None: the sidecar chooses).
    prefill_rank: int | None = None
    #: The client's body as it came (a single request): what a local run sends, unchanged.
    raw: bytes | None = None


@dataclass(slots=True)
class Handoff:
    """What a prefill leg produced for its decode: the top-level ``fields`` of the decode body,
    or (empty fields) the ``answer`` as the client sees it when the prefill already is one."""

    fields: dict[str, Any]
    answer: dict[str, Any] | None = None
    timings: Timings = field(default_factory=Timings)
    #: The prefill engine's answer (its usage is what the client is told: the usage rule).
    response: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class FlowCounters:
    """What the flow counts: local-prefill fallbacks (front door, reason) and retries."""

    fallback: Callable[[str, str], None] = lambda front_door, reason: None
    retry: Callable[[str], None] = lambda front_door: None
