"""A request's legs: what a way of running a pair is given (``Pair``), the sequential way,
and what the relay reads once the decode has answered (``PDExchange``).

    Pair(request, ctx, dialect, calls, ...)   one pair's legs on one placement decision
        .prefill_leg()           the prefill engine call (body, headers, deadline, rank)
        .handoff(answer)         the decode's hand-off fields (in the hand-off span)
        .decode_body(fields) / .open_decode(body)   the decode leg
        .exchange(decode, ...)   the relay's side, ended by the pair's owner (the runner)
    run_sequential(pair)         prefill ─▶ hand-off ─▶ open decode (the concurrent way:
                                 ``sidecar.request.concurrent``)
    PDExchange
        .decode      the decode engine's response (None when the prefill answered, ``answer``)
        .prefill_reply()   the prefill engine's JSON answer (its usage: the usage rule),
                     at hand for sequential legs, awaited for concurrent ones
        .chunks()    its body as the engine writes it; a break raises a ``SidecarError``
        .pipe(sink, catch_up)   the same bytes handed to ``sink`` from the read callback
                     (the streamed relay's way: no task wake-up per read), same errors
        .aclose()    close the decode, stop a running prefill, abort the legs of a decode
                     that did not finish and end the dialect state (through ``owner``), once

A concurrent pair's prefill is watched (``watch_prefill``): its failure closes the decode, so
the relay's read fails at once with its error, not at the engines' bootstrap timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from sidecar import jsonutil
from sidecar.dialects import Dialect
from sidecar.engines.calls import EngineCalls, PrefillLeg, with_headers
from sidecar.errors import DeadlineExceeded, DecodeFailed, PrefillFailed, SidecarError, Stage
from sidecar.http1 import UpstreamError, UpstreamResponse
from sidecar.observability.tracing import HANDOFF_SPAN, NOOP_TRACE, RequestTrace
from sidecar.protocol.context import FrontDoor, HandoffContext, PrefillTarget, Route
from sidecar.request.scope import OK, Timings
from sidecar.tasks import cancel_and_wait

if TYPE_CHECKING:
    from sidecar.request.placement import Decision


class LegOwner(Protocol):
    """Who started an exchange's legs, and ends them: the runner."""

    def abort(self, ctx: HandoffContext) -> None:
        """Tell the engines to drop the request's legs (where the dialect can)."""

    def end(self, ctx: HandoffContext) -> None:
        """Give back the request's dialect state."""


class PDRequest(msgspec.Struct, frozen=True):
    """One client request that may run as a prefill/decode pair."""

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
    #: Fields the engine serving the answer gets besides the client's (a stream that may move
    #: asks for its token ids: ``sidecar.request.migration``); none for most requests.
    engine_fields: Mapping[str, Any] = msgspec.field(default_factory=dict)

    def engine_body(self) -> Mapping[str, Any] | bytes:
        """What a whole run sends: the client's body as it came (its raw bytes when at hand),
        with ``engine_fields``."""
        fields = self.engine_fields
        if self.raw is not None and not any(key in self.body for key in fields):
            return jsonutil.with_fields(self.raw, dict(fields))
        if not fields:
            return self.body
        return {**self.body, **fields}


def traced_handoff(dialect: Dialect, response: dict[str, Any] | None, ctx: HandoffContext,
                   trace: RequestTrace) -> dict[str, Any]:
    """The dialect's hand-off fields, in the request's hand-off span when traced."""
    if not trace.active:
        return dialect.handoff(response, ctx)
    with trace.span(HANDOFF_SPAN):
        return dialect.handoff(response, ctx)


class Pair:
    """One request's two legs on one placement decision: what each way of running uses."""

    __slots__ = ("calls", "ctx", "dialect", "owner", "prefill_timeout_s", "request", "timings")

    def __init__(self, request: PDRequest, ctx: HandoffContext, dialect: Dialect,
                 calls: EngineCalls, *, prefill_timeout_s: float, owner: LegOwner) -> None:
        self.request = request
        self.ctx = ctx
        self.dialect = dialect
        self.calls = calls
        self.prefill_timeout_s = prefill_timeout_s
        self.owner = owner
        self.timings = Timings()

    def prefill_leg(self) -> PrefillLeg:
        request, ctx, dialect = self.request, self.ctx, self.dialect
        target = request.target
        return PrefillLeg(
            url=self.calls.prefill_url(target, request.route),
            body=dialect.prefill_body(request.body, ctx),
            headers=with_headers(request.headers, dialect.prefill_headers(ctx)),
            timeout_s=self.prefill_timeout_s,
            server_hostname=target.tls_name,
            target=target,
            trace=request.trace,
            rank=ctx.prefill_rank,
        )

    def handoff(self, response: dict[str, Any] | None) -> dict[str, Any]:
        """The decode's hand-off fields (``InvalidHandoff`` when unusable; ``response`` None:
        a concurrent dialect's, built before the prefill answers)."""
        return traced_handoff(self.dialect, response, self.ctx, self.request.trace)

    def decode_body(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        body = self.dialect.decode_body(self.request.body, fields, self.ctx.decode_rank)
        extra = self.request.engine_fields
        if extra:
            body.update(extra)
        return body

    def open_decode(self, body: Mapping[str, Any]) -> Awaitable[UpstreamResponse]:
        request, rank = self.request, self.ctx.decode_rank
        return self.calls.open_decode(
            request.route, body, with_headers(request.headers, self.dialect.decode_headers(rank)),
            request.trace, rank,
        )

    def exchange(self, decode: UpstreamResponse | None, **fields: Any) -> PDExchange:
        """The relay's side of this pair, ended by its owner when the relay closes it."""
        return PDExchange(ctx=self.ctx, decode=decode, timings=self.timings, owner=self.owner,
                          **fields)


#: A way of running a pair, until its decode head arrived (or its answer is known).
Way = Callable[[Pair], Awaitable["PDExchange"]]


async def run_sequential(pair: Pair) -> PDExchange:
    """Prefill, then the decode with the hand-off from its answer."""
    timings = pair.timings
    started = time.perf_counter()
    response = await pair.calls.post_prefill(pair.prefill_leg())
    timings.prefill = time.perf_counter() - started
    dialect = pair.dialect
    if dialect.answered_by_prefill(response):
        return pair.exchange(None, answer=dialect.prefill_answer(response))
    handoff_started = time.perf_counter()
    fields = pair.handoff(response)
    timings.handoff = time.perf_counter() - handoff_started
    decode_started = time.perf_counter()
    decode = await pair.open_decode(pair.decode_body(fields))
    timings.decode_first_byte = time.perf_counter() - decode_started
    return pair.exchange(decode, prefill_response=response)


@dataclass(slots=True, eq=False)
class PDExchange:
    """A PD request whose decode response head has arrived (or whose answer is known)."""

    ctx: HandoffContext
    decode: UpstreamResponse | None
    answer: dict[str, Any] | None = None
    fallback_reason: str | None = None
    timings: Timings = field(default_factory=Timings)
    prefill_task: asyncio.Task[dict[str, Any]] | None = None
    prefill_error: SidecarError | None = None
    completed: bool = False
    #: Run whole on the local engine (the placement decision's): no prefill leg, no hand-off.
    local: bool = False
    #: What the request is counted with (``disagg_requests_total{outcome}``), as it started.
    outcome: str = OK
    #: Ends the legs and the dialect state on ``aclose`` (None: nothing to end).
    owner: LegOwner | None = None
    #: The prefill engine's JSON answer, when the legs ran one after the other.
    prefill_response: dict[str, Any] | None = None
    #: The decision a moved request ran on (``Runner.move``; None: the one it was given).
    decision: Decision | None = None
    _closed: bool = False

    @property
    def disaggregated(self) -> bool:
        """True when a remote prefill leg computed the prompt (not local, not a fallback)."""
        return not self.local and self.fallback_reason is None and self.decode is not None

    def prefill_reply_now(self) -> dict[str, Any] | None:
        """The prefill's answer if it is known already (None: not yet, or none)."""
        if self.prefill_response is not None:
            return self.prefill_response
        task = self.prefill_task
        if task is not None and task.done() and not task.cancelled() and (
                task.exception() is None):
            return task.result()
        return None

    def prefill_reply_pending(self) -> bool:
        """True while a concurrent prefill has not answered yet."""
        task = self.prefill_task
        return self.prefill_response is None and task is not None and not task.done()

    async def prefill_reply(self) -> dict[str, Any] | None:
        """The prefill's JSON answer, waiting for a concurrent prefill (bounded by its own
        deadline); None when there is none (a failed or cancelled prefill)."""
        if self.prefill_response is not None or self.prefill_task is None:
            return self.prefill_response
        try:
            return await asyncio.shield(self.prefill_task)
        except asyncio.CancelledError:
            if self.prefill_task.cancelled():
                return None
            raise
        except Exception:
            return None

    def watch_prefill(self) -> None:
        """Abort the decode stream at once if the concurrent prefill fails."""
        if self.prefill_task is not None:
            self.prefill_task.add_done_callback(self._on_prefill_done)

    def _on_prefill_done(self, task: asyncio.Task[dict[str, Any]]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is None:
            return
        self.prefill_error = as_prefill_error(error)
        if self.decode is not None:
            # Closing the connection makes the pending read fail and tells the engine.
            self.decode.close()

    def _stream_error(self, exc: BaseException) -> SidecarError:
        if self.prefill_error is not None:
            return self.prefill_error
        if isinstance(exc, TimeoutError):
            return DeadlineExceeded("decode stream stalled past the read deadline",
                                    stage=Stage.DECODE)
        return DecodeFailed("decode engine broke its stream", stage=Stage.DECODE)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The decode body as the engine writes it; raises a ``SidecarError`` on a break."""
        if self.decode is None:
            raise SidecarError("chunks() called on an exchange answered by its prefill")
        # readany() hands over everything queued since the last read: under load one chunk
        # carries several tokens, so the per-chunk costs below are paid once for them all.
        read = self.decode.readany
        try:
            while chunk := await read():
                yield chunk
        except (UpstreamError, TimeoutError) as exc:
            raise self._stream_error(exc) from None
        if self.prefill_error is not None:
            raise self.prefill_error
        self.completed = True

    async def pipe(
        self, sink: Callable[[bytes], bool], catch_up: Callable[[], Awaitable[None]]
    ) -> None:
        """The decode body handed to ``sink`` read by read (``UpstreamResponse.pipe``);
        raises a ``SidecarError`` on a break, as ``chunks()`` does."""
        if self.decode is None:
            raise SidecarError("pipe() called on an exchange answered by its prefill")
        try:
            await self.decode.pipe(sink, catch_up)
        except (UpstreamError, TimeoutError) as exc:
            raise self._stream_error(exc) from None
        if self.prefill_error is not None:
            raise self.prefill_error
        self.completed = True

    async def read_all(self, max_bytes: int) -> bytes:
        """The whole decode body (JSON answers), capped."""
        buffer = bytearray()
        async for chunk in self.chunks():
            buffer += chunk
            if len(buffer) > max_bytes:
                raise DecodeFailed("decode answer exceeds the size cap", stage=Stage.DECODE)
        return bytes(buffer)

    async def aclose(self) -> None:
        """Close the decode response, stop a running prefill, release ids. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.decode is not None:
            self.decode.close()
        try:
            if self.prefill_task is not None:
                await cancel_and_wait(self.prefill_task)
        finally:  # the caller's cancellation too: the legs and ids are still ended
            owner = self.owner
            if owner is not None:
                if not self.completed and self.decode is not None:
                    owner.abort(self.ctx)
                owner.end(self.ctx)


def as_prefill_error(error: BaseException) -> SidecarError:
    """A prefill leg's failure as the taxonomy names it."""
    if isinstance(error, SidecarError):
        return error
    return PrefillFailed("prefill leg failed unexpectedly")


async def cancel_legs(decode: asyncio.Task[UpstreamResponse],
                      prefill: asyncio.Task[Any]) -> None:
    """Stop a concurrent flow's two leg tasks and wait for them; a decode head that came in
    the turn the prefill failed is closed, whatever becomes of the caller."""
    try:
        await cancel_and_wait(decode, prefill)
    finally:
        if decode.done() and not decode.cancelled() and decode.exception() is None:
            decode.result().close()
