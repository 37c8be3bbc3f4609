"""Fakes for the core's unit tests: engine calls and decode responses the test drives itself.

    calls = FakeCalls()                       duck-typed ``EngineCalls`` (no sockets)
    calls.prefill_answers({...})              the next prefill leg answers this (or raises it)
    held = calls.hold_prefill()               ... or waits until the test resolves ``held``
    calls.decode_answers(FakeUpstream(...))   the next decode head (or an error, or held)
    calls.prefills / .decodes / .aborts       what the core sent, in order
    await calls.until(prefills=1)             until the core has made that call (an event)
    FakeUpstream(b"a", b"")                   a decode response; ``feed`` more, ``close`` fails
                                              a pending read as the real connection does;
                                              ``reading`` is set while a read waits
    recording(SGLangDialect)                  a real dialect that also records begin/end
                                              (``begun``, ``ended``, event ``end_seen``)
    flow_of(dialect, calls, ...)              a ``Runner`` over them (ids fixed by ``install``)

Every outcome is scripted: a call the script does not expect fails the test
(``UnexpectedCall``), so a test that forgets an engine call cannot pass by accident.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from protocol_builders import install, make_ids

from sidecar.config.limits import PrefillFailurePolicy
from sidecar.dialects import Dialect
from sidecar.engines.calls import EngineCalls, PrefillLeg
from sidecar.errors import Stage
from sidecar.http1 import UpstreamBroken, UpstreamResponse
from sidecar.observability.metrics import Metrics
from sidecar.observability.tracing import NOOP_TRACE, RequestTrace
from sidecar.protocol.context import FrontDoor, HandoffContext, PrefillTarget, Route
from sidecar.request.legs import PDRequest
from sidecar.request.placement import Rules
from sidecar.request.runner import FlowCounters, Runner
from sidecar.request.scope import Admission, Scopes
from sidecar.targets.choice import LegRanks, PrefillTargets, RankChoice, TargetChoice

D = TypeVar("D", bound=Dialect)

ENGINE_URL = "http://127.0.0.1:8000"
TARGET_A = PrefillTarget("10.0.0.1", 8100)
TARGET_B = PrefillTarget("10.0.0.2", 8100)
TARGET_C = PrefillTarget("10.0.0.3", 8100)
#: An abort call for dialects that have none (the flow does not care which dialect asks).
TEST_ABORT_PATH = "/test/abort"


class UnexpectedCall(AssertionError):
    """The core made an engine call the test did not script."""


class FakeUpstream:
    """A decode response whose body the test feeds; the surface of ``UpstreamResponse`` the
    core uses (``readany``, ``pipe``, ``close``, ``release``, ``header``).

    ``close()`` fails a pending read with ``UpstreamBroken``, as closing a real connection
    whose response has not ended does.
    """

    def __init__(self, *items: bytes | BaseException,
                 headers: Mapping[str, str] | None = None) -> None:
        self._items: deque[bytes | BaseException] = deque(items)
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False
        self.headers = list((headers or {}).items())
        self.status = 200
        self.closed = False
        self.released = False
        self.read_cancelled = False
        #: Set while a reader waits for bytes (the test may then act on a pending read).
        self.reading = asyncio.Event()

    def feed(self, item: bytes | BaseException) -> None:
        """The engine writes ``item`` (bytes; b"" ends the body) or the connection raises it."""
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name.lower():
                return value
        return None

    async def readany(self) -> bytes:
        if self._ended:
            return b""
        if not self._items:
            if self.closed:
                raise UpstreamBroken("read on a closed connection")
            self._waiter = asyncio.get_running_loop().create_future()
            self.reading.set()
            try:
                await self._waiter
            except asyncio.CancelledError:
                self.read_cancelled = True
                raise
            finally:
                self._waiter = None
                self.reading.clear()
        item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        if not item:
            self._ended = True
        return item

    async def pipe(self, sink: Callable[[bytes], bool],
                   catch_up: Callable[[], Awaitable[None]]) -> None:
        """As ``UpstreamResponse.pipe``: each read to ``sink``; ``catch_up`` when it is full."""
        while chunk := await self.readany():
            if not sink(chunk):
                await catch_up()

    def close(self) -> None:
        self.closed = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(
                UpstreamBroken("connection closed before the response ended"))

    def release(self) -> None:
        self.released = True


def as_upstream(fake: FakeUpstream) -> UpstreamResponse:
    """``fake`` where the core's signatures want the real response."""
    return cast(UpstreamResponse, fake)


@dataclass(frozen=True)
class DecodeCall:
    route: Route
    body: Any  # a JSON body (gRPC Decode may send bytes)
    headers: Mapping[str, str]
    #: The local engine's data-parallel rank it ran on (None: one rank).
    rank: int | None = None


#: A scripted outcome: an answer, an error to raise, or a future the test resolves.
Outcome = Any


class FakeCalls:
    """``EngineCalls`` without sockets: every call is recorded and answered from a script."""

    def __init__(self, *, choice: TargetChoice | None = None,
                 model: str = "m", engine_url: str = ENGINE_URL) -> None:
        self.choice = choice or TargetChoice(cooldown_s=0.0, rng=random.Random(7))
        self.ranks = RankChoice(cooldown_s=0.0)
        self.engine_url = engine_url
        self.model = model
        self._prefill: deque[Outcome] = deque()
        self._decode: deque[Outcome] = deque()
        self.prefills: list[PrefillLeg] = []
        self.decodes: list[DecodeCall] = []
        self.aborts: list[tuple[str, Mapping[str, Any], PrefillTarget]] = []
        #: "prefill" / "decode" for each call cancelled while it waited.
        self.cancelled: list[str] = []
        self._called = asyncio.Event()

    # The real one: it only reads the choice's labels.
    for_client = EngineCalls.for_client

    async def until(self, *, prefills: int = 0, decodes: int = 0) -> None:
        """Wait until the core has made at least this many calls of each kind."""
        while len(self.prefills) < prefills or len(self.decodes) < decodes:
            self._called.clear()
            await self._called.wait()

    # -- the script ---------------------------------------------------------------------

    def prefill_answers(self, *outcomes: Outcome) -> None:
        self._prefill.extend(outcomes)

    def decode_answers(self, *outcomes: Outcome) -> None:
        self._decode.extend(outcomes)

    def hold_prefill(self) -> asyncio.Future[Any]:
        """The next prefill leg waits for the returned future (its result or exception)."""
        held: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._prefill.append(held)
        return held

    def hold_decode(self) -> asyncio.Future[Any]:
        held: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._decode.append(held)
        return held

    @staticmethod
    async def _resolve(kind: str, script: deque[Outcome], cancelled: list[str]) -> Any:
        if not script:
            raise UnexpectedCall(f"unscripted {kind} call")
        outcome = script.popleft()
        if isinstance(outcome, asyncio.Future):
            try:
                outcome = await outcome
            except asyncio.CancelledError:
                cancelled.append(kind)
                raise
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    # -- the EngineCalls surface the flow uses -------------------------------------------

    def local_url(self, route: Route | str) -> str:
        return self.engine_url + str(route)

    def prefill_url(self, target: PrefillTarget, route: Route) -> str:
        return target.base_url + route.value

    async def model_name(self, stage: Stage) -> str:
        return self.model

    async def post_prefill(self, leg: PrefillLeg) -> dict[str, Any]:
        self.prefills.append(leg)
        self._called.set()
        answer = await self._resolve("prefill", self._prefill, self.cancelled)
        return cast(dict[str, Any], answer)

    async def open_decode(self, route: Route, body: Mapping[str, Any] | bytes,
                          headers: Mapping[str, str],
                          trace: RequestTrace = NOOP_TRACE,
                          rank: int | None = None) -> UpstreamResponse:
        self.decodes.append(DecodeCall(route, body, headers, rank))
        self._called.set()
        response = await self._resolve("decode", self._decode, self.cancelled)
        return cast(UpstreamResponse, response)

    def abort(self, path: str, body: Mapping[str, Any], target: PrefillTarget) -> None:
        self.aborts.append((path, body, target))


def recording(cls: type[D], *, abort_call: bool = False) -> type[Any]:
    """``cls`` that also records each request's ``begin`` and ``end`` (``begun``/``ended``);
    with ``abort_call``, a dialect without one gets ``TEST_ABORT_PATH`` (to see whether the
    flow asks for an abort at all)."""

    class Recording(cls):  # type: ignore[valid-type,misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.begun: list[HandoffContext] = []
            self.ended: list[HandoffContext] = []
            #: Set at each ``end``: a background leg's state (and admission) was given back.
            self.end_seen = asyncio.Event()

        def begin(self, ctx: HandoffContext) -> HandoffContext:
            ctx = super().begin(ctx)
            self.begun.append(ctx)
            return ctx

        def end(self, ctx: HandoffContext) -> None:
            self.ended.append(ctx)
            super().end(ctx)
            self.end_seen.set()

        def abort_call(self, ctx: HandoffContext) -> tuple[str, dict[str, Any]] | None:
            call: tuple[str, dict[str, Any]] | None = super().abort_call(ctx)
            if call is None and abort_call:
                return TEST_ABORT_PATH, {"request_id": ctx.request_id}
            return call

    Recording.__name__ = f"Recording{cls.__name__}"
    return Recording


@dataclass
class Counted:
    """What a flow counted (``FlowCounters``): fallbacks (door, reason) and retries (door)."""

    fallbacks: list[tuple[str, str]]
    retries: list[str]

    def counters(self) -> FlowCounters:
        return FlowCounters(fallback=lambda door, reason: self.fallbacks.append((door, reason)),
                            retry=self.retries.append)


def counted() -> Counted:
    return Counted([], [])


def flow_of(
    dialect: Dialect,
    calls: FakeCalls,
    *,
    prefill_timeout_s: float = 30.0,
    on_prefill_failure: PrefillFailurePolicy = PrefillFailurePolicy.FAIL,
    counts: Counted | None = None,
) -> Runner:
    """A runner over ``dialect`` (fixed ids installed) and the fake calls, choosing among
    targets with the calls' own ``choice`` (its breakers, cool-downs and ranks)."""
    install(dialect, make_ids())
    engine_calls = cast(EngineCalls, calls)
    ranks = LegRanks(engine_calls.ranks)
    return Runner(dialect, engine_calls, PrefillTargets(engine_calls.choice, ranks), ranks,
                  prefill_timeout_s=prefill_timeout_s,
                  rules=Rules(local_fallback=on_prefill_failure is PrefillFailurePolicy.LOCAL),
                  counters=counts.counters() if counts is not None else None)


def pd_request(
    body: Mapping[str, Any],
    *,
    target: PrefillTarget = TARGET_A,
    candidates: tuple[PrefillTarget, ...] = (),
    route: Route = Route.COMPLETIONS,
    request_id: str = "rq-1",
    front_door: FrontDoor = FrontDoor.HTTP,
) -> PDRequest:
    return PDRequest(route=route, body=body, stream=bool(body.get("stream")), target=target,
                     request_id=request_id, headers={"X-Request-Id": request_id},
                     candidates=candidates, front_door=front_door)


def scopes_of(metrics: Metrics, admission: Admission, *, front_door: str = "http",
              engine: str = "vllm", connector: str = "shfs") -> Scopes:
    return Scopes(metrics, admission, front_door=front_door, engine=engine, connector=connector)


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    """A sample of the registry by its exposed name (0 when it was never set)."""
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value
