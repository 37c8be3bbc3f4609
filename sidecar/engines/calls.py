"""Every call the core makes to an engine, with its URL, deadline, span and accounting, over
the process's one pooled client (``make_session``: keep-alive below the engines' 5 s; one
client serves every upstream, its connection limit is global; why these knobs:
docs/extending/design-notes.md#upstream-client).

    post_prefill(leg)              ─▶ the prefill's JSON answer (a remote target's leg counts as
                                      in flight there; a refused connect cools the target down;
                                      a leg on a data-parallel rank counts there, and a failed
                                      one cools the rank down)
    open_decode(route, body, ...)  ─▶ UpstreamResponse (head arrived, status 200; a rank as
                                      for the prefill, on the local engine)
    open_on(engine, route, body, ...) ─▶ the same, on a chosen engine (None: the local one): a
                                      request moved whole there (``sidecar.request.migration``)
    post_engine(engine, path, body)   ─▶ a small JSON call to a chosen engine (a migration's
                                      look-up of what token ids read as)
    post_local(path, body, ...)    ─▶ a small JSON call to the local engine (its tokenizer)
    passthrough(method, path, ...) ─▶ the local engine's raw response (HTTP passthrough)
    model_name(stage)              ─▶ the local engine's served model (gRPC bodies)
    abort(path, body, target)         a dialect's abort call to both engines, in the background
    get(url, max_bytes=)              a dialect's side-channel lookup (``EngineLookup``)

The two calls of a pair at the wire (``post_prefill``: the prefill's JSON answer, size-capped
and deadline-bound; ``open_decode``: the decode's head, its body left to the caller) map
every failure to the taxonomy, as ``sidecar.engines.failures`` tells it: unreachable ->
PrefillUnreachable / EngineNotReady, a failed TLS handshake -> PrefillFailed/DecodeFailed,
4xx -> EngineRejected, 5xx or garbage -> PrefillFailed/DecodeFailed, deadlines ->
DeadlineExceeded. This module knows no engine: bodies, paths, headers (``with_headers``: a
dialect's over the client's) and abort calls come from the dialect. A traced call runs in
its leg span, the ``traceparent`` the engine receives; an untraced one is the plain call,
with no extra coroutine layer (docs/extending/design-notes.md#untraced-calls).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterable, Awaitable, Callable, Coroutine, Mapping
from typing import Any, Final, Protocol, TypeVar
from urllib.parse import urlsplit

import msgspec
from multidict import CIMultiDict
from opentelemetry.util.types import AttributeValue

from sidecar import jsonutil
from sidecar.bounded import BoundedMap
from sidecar.config.settings import Settings
from sidecar.dialects.base import LookupFailed
from sidecar.engines.failures import (
    DECODE_ENGINE,
    LOCAL_ENGINE,
    broken_connection,
    connect_failure,
    drain_error_body,
    for_client,
    log_tls_failure,
    status_error,
)
from sidecar.engines.models import EngineModel
from sidecar.errors import (
    DeadlineExceeded,
    DecodeFailed,
    EngineNotReady,
    EngineRejected,
    PrefillFailed,
    PrefillUnreachable,
    SidecarError,
    Stage,
)
from sidecar.http1 import (
    EngineClient,
    UpstreamConnectError,
    UpstreamError,
    UpstreamResponse,
    UpstreamTLSError,
)
from sidecar.observability.tracing import (
    DECODE_FIRST_BYTE_SPAN,
    HTTP_STATUS,
    NOOP_SPAN,
    NOOP_TRACE,
    PREFILL_SPAN,
    PREFILL_TARGET,
    SERVER_ADDRESS,
    SERVER_PORT,
    LegSpan,
    RequestTrace,
)
from sidecar.protocol.context import PrefillTarget, Route, url_port
from sidecar.protocol.request import REQUEST_ID_HEADER
from sidecar.targets.choice import HEADER_LABEL, LOCAL, Engine, RankChoice, TargetChoice
from sidecar.tasks import cancel_and_wait
from sidecar.tls import client_ssl_context

logger = logging.getLogger(__name__)

#: Prefill URLs remembered per (target, route): the oldest made forgotten first (read with
#: ``peek``, at a dict's speed: every pair reads it).
_MAX_REMEMBERED_URLS: Final = 4096
_JSON_HEADERS: Final = {"Content-Type": "application/json"}
#: An abort call's answer is a short acknowledgement; it is read only to keep the connection.
_MAX_ABORT_ANSWER: Final = 64 * 1024
#: How messages name an engine a request moved to (its address only in the log).
MOVED_ENGINE: Final = "the engine the request moved to"

class Count(Protocol):
    """A counter's handle (``observability.prometheus_private.CounterValue``)."""

    def inc(self, amount: float = 1.0) -> None: ...


#: The counter of finished prefill legs to a remote target: (target label, outcome).
LegCounter = Callable[[str, str], Count]
#: The counter of finished legs on a data-parallel rank: (leg "prefill" | "decode", rank,
#: outcome).
RankCounter = Callable[[str, int, str], Count]

_T = TypeVar("_T")

def _named(who: str | PrefillTarget) -> str:
    """The engine of a failed call as its message names it (a router-named target by its
    address; formatted only when a call failed)."""
    return who if isinstance(who, str) else f"prefill target {who}"


async def read_capped(response: UpstreamResponse, max_bytes: int) -> bytes:
    """The whole body, refusing more than ``max_bytes`` while reading."""
    length = response.content_length
    if length is not None and length > max_bytes:
        raise PrefillFailed(f"prefill response of {length} bytes exceeds the cap")
    raw = await response.read(max_bytes)
    if len(raw) > max_bytes:
        raise PrefillFailed("prefill response exceeds the size cap")
    return raw


def _json_headers(headers: Mapping[str, str]) -> list[tuple[str, str]]:
    """``headers`` with the body's own Content-Type (a client's would be a second one)."""
    out = [(name, value) for name, value in headers.items() if name.lower() != "content-type"]
    out.append(("Content-Type", "application/json"))
    return out


async def post_prefill(
    session: EngineClient,
    url: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    *,
    timeout_s: float,
    max_bytes: int,
    server_hostname: str | None = None,
    span: LegSpan = NOOP_SPAN,
    who: str | PrefillTarget = "prefill engine",
) -> dict[str, Any]:
    """POST the prefill body and return its JSON object answer (``server_hostname``: the
    name an https target's certificate must carry when ``url`` names its address; ``who``:
    a router-named target (named in the messages by its address, written only on failure), or
    the engine as the messages name it)."""
    payload = jsonutil.dumps(body)
    try:
        response = await session.request(
            "POST", url, headers=_json_headers(headers), body=payload, timeout_s=timeout_s,
            server_hostname=server_hostname,
        )
        if span.recording:
            span.set(HTTP_STATUS, response.status)
        try:
            if response.status != 200:
                error_body = await drain_error_body(response)
                raise status_error(response.status, Stage.PREFILL, _named(who), error_body)
            raw = await read_capped(response, max_bytes)
        finally:
            response.release()
    except TimeoutError:
        raise DeadlineExceeded(
            f"prefill leg exceeded its {timeout_s:g} s deadline", stage=Stage.PREFILL
        ) from None
    except UpstreamTLSError as exc:
        log_tls_failure(url, exc)
        raise PrefillFailed(connect_failure(exc, _named(who))) from None
    except UpstreamConnectError as exc:
        # No connection, so not one byte of the request reached the engine: safe to retry.
        raise PrefillUnreachable(connect_failure(exc, _named(who))) from None
    except UpstreamError as exc:
        raise PrefillFailed(broken_connection(exc, _named(who))) from None
    try:
        answer = jsonutil.loads(raw)
    except jsonutil.JSONDecodeError:
        raise PrefillFailed(f"{_named(who)} answered malformed JSON") from None
    if not isinstance(answer, dict):
        raise PrefillFailed(f"{_named(who)} answered JSON that is not an object")
    return answer


async def open_decode(
    session: EngineClient,
    url: str,
    body: Mapping[str, Any] | bytes,
    headers: Mapping[str, str],
    span: LegSpan = NOOP_SPAN,
    *,
    server_hostname: str | None = None,
    who: str = LOCAL_ENGINE,
    answering: str = DECODE_ENGINE,
) -> UpstreamResponse:
    """POST the decode body; return the response once its head arrived (status 200).
    ``who``/``answering``: the engine as a failure to reach it / of its answer names it."""
    payload = body if isinstance(body, bytes) else jsonutil.dumps(body)
    try:
        response = await session.request(
            "POST", url, headers=_json_headers(headers), body=payload,
            server_hostname=server_hostname,
        )
    except UpstreamTLSError as exc:
        log_tls_failure(url, exc)
        raise DecodeFailed(connect_failure(exc, who), stage=Stage.DECODE) from None
    except UpstreamConnectError as exc:
        raise EngineNotReady(connect_failure(exc, who), stage=Stage.DECODE) from None
    except TimeoutError:
        raise DeadlineExceeded(f"{answering} did not answer in time",
                               stage=Stage.DECODE) from None
    except UpstreamError as exc:
        raise DecodeFailed(broken_connection(exc, answering), stage=Stage.DECODE) from None
    if span.recording:
        span.set(HTTP_STATUS, response.status)
    if response.status != 200:
        try:
            body = await drain_error_body(response)
        finally:
            response.release()
        raise status_error(response.status, Stage.DECODE, answering, body)
    return response



def rank_outcome(error: BaseException | None) -> str:
    """How a ranked leg ended, as its metric says: ``ok``; ``failed`` (the rank's doing: it
    cools down); ``connect_refused`` (the whole engine's); ``rejected`` (the request's)."""
    if error is None:
        return "ok"
    if isinstance(error, (PrefillUnreachable, EngineNotReady)):
        return "connect_refused"
    if isinstance(error, EngineRejected):
        return "rejected"
    return "failed"


class PrefillLeg(msgspec.Struct, frozen=True):
    """One prefill engine call: where, what, with which headers, within which deadline, and
    in which request's trace."""

    url: str
    body: Mapping[str, Any]
    headers: Mapping[str, str]
    timeout_s: float
    #: The name an https target's certificate must carry when ``url`` names its address.
    server_hostname: str | None = None
    #: The prefill target this leg goes to, when it is a remote one (counted per target).
    target: PrefillTarget | None = None
    trace: RequestTrace = NOOP_TRACE
    #: The data-parallel rank of the leg's engine (``target``, else the local one), if any.
    rank: int | None = None


class EngineCalls:
    """The engine calls of one process, over its pooled client."""

    def __init__(
        self,
        session: EngineClient,
        engine_url: str,
        *,
        connect_timeout_s: float,
        max_prefill_response_bytes: int,
        choice: TargetChoice | None = None,
        ranks: RankChoice | None = None,
        on_prefill_leg: LegCounter | None = None,
        on_rank_leg: RankCounter | None = None,
    ) -> None:
        self.session = session
        self.engine_url = engine_url.rstrip("/")
        self._connect_timeout_s = connect_timeout_s
        self._max_prefill_bytes = max_prefill_response_bytes
        self.choice = choice if choice is not None else TargetChoice(cooldown_s=0.0)
        self.ranks = ranks if ranks is not None else RankChoice(cooldown_s=0.0)
        self._on_prefill_leg = on_prefill_leg
        self._on_rank_leg = on_rank_leg
        # Each label and rank's counters, fetched once (their keys are bounded: pool members
        # or "header", ranks below the data-parallel size, a closed set of outcomes).
        self._leg_counts: dict[tuple[str, str], Count] = {}
        self._rank_counts: dict[tuple[str, int, str], Count] = {}
        self._aborts: set[asyncio.Task[None]] = set()
        self._prefill_urls: BoundedMap[tuple[PrefillTarget, Route], str] = BoundedMap(
            _MAX_REMEMBERED_URLS)
        self._model_name: str | None = None
        self._models = {
            stage: EngineModel(session, engine_url, timeout_s=connect_timeout_s, stage=stage)
            for stage in (Stage.PREFILL, Stage.DECODE)
        }

    # -- addresses --------------------------------------------------------------------------

    def local_url(self, route: Route | str) -> str:
        return self.engine_url + str(route)

    def for_client(self, error: SidecarError, target: PrefillTarget,
                   request_id: str) -> SidecarError:
        """``error`` as ``target``'s client may see it (``legs.for_client``: an address only
        for a target the router named)."""
        return for_client(error, self.choice.label(target) == HEADER_LABEL, request_id)

    def prefill_url(self, target: PrefillTarget, route: Route) -> str:
        """The prefill leg's URL (remembered: formatting it parses the host each time)."""
        key = (target, route)
        url = self._prefill_urls.peek(key)
        if url is None:
            url = self._prefill_urls[key] = target.base_url + route.value
        return url

    async def model_name(self, stage: Stage) -> str:
        """The local engine's served model name (looked up once; ``EngineNotReady`` when
        unknown, the error naming ``stage``)."""
        name = self._model_name
        if name is None:
            name = self._model_name = await self._models[stage].name()
        return name

    # -- prefill ----------------------------------------------------------------------------

    async def post_prefill(self, leg: PrefillLeg) -> dict[str, Any]:
        """POST a prefill leg and return its JSON object answer.

        A leg to a remote target counts as in flight there while it runs; a refused connect
        cools the target down, and the leg's verdict goes to the target's circuit breaker
        (``TargetChoice``): failures that show the engine unhealthy (5xx, resets, garbage,
        deadlines, refused or unreachable connects) count against it, a 4xx or 429 answer
        (the request's own fault, or a busy engine) and a cancelled leg do not. A leg its
        breaker does not let through raises ``PrefillBreakerOpen`` and is not counted. A leg
        on a data-parallel rank counts on that rank.
        """
        if leg.target is None:
            return await self._on_rank(leg, self._post(leg, "prefill engine"))
        target = leg.target
        label = self.choice.label(target)
        # The router named it: the client's message may name it too (a pool member, which
        # the router does not know, is named in the log only).
        who: str | PrefillTarget = target if label == HEADER_LABEL else "prefill engine"
        outcome: str | None = None
        try:
            with self.choice.leg(target) as verdict:
                outcome = "failed"
                try:
                    answer = await self._on_rank(leg, self._post(leg, who))
                except PrefillUnreachable as error:
                    outcome = "connect_refused"
                    self.choice.refused(target)
                    verdict.failed(error.message, down=True)
                    self._log_failed_leg(leg, target, error)
                    raise
                except SidecarError as error:
                    if engine_fault(error):
                        verdict.failed(error.message)
                    self._log_failed_leg(leg, target, error)
                    raise
                except asyncio.CancelledError:
                    outcome = None  # the request went away: not the target's doing
                    raise
                outcome = "ok"
                verdict.answered()
            self.choice.answered(target)
            return answer
        finally:
            if self._on_prefill_leg is not None and outcome is not None:
                count = self._leg_counts.get((label, outcome))
                if count is None:
                    count = self._leg_counts[label, outcome] = self._on_prefill_leg(label,
                                                                                    outcome)
                count.inc()

    @staticmethod
    def _log_failed_leg(leg: PrefillLeg, target: PrefillTarget, error: SidecarError) -> None:
        logger.warning("request %s: prefill leg to %s failed: %s (%s)",
                       leg.headers.get(REQUEST_ID_HEADER, "-"), target, error.code,
                       error.message)

    def _on_rank(self, leg: PrefillLeg, post: Awaitable[_T]) -> Awaitable[_T]:
        """``post`` counted on the leg's data-parallel rank, when it has one."""
        if leg.rank is None:
            return post
        return self._ranked("prefill", leg.target, leg.rank, post)

    async def _ranked(self, leg: str, engine: Engine, rank: int, call: Awaitable[_T], *,
                      counts: bool = True) -> _T:
        """``call`` on ``rank`` of ``engine`` (counted in flight there unless the caller counts
        it); a failure that is the rank's (not the whole engine's, nor the request's) cools
        the rank down; the outcome is counted (a cancelled call is not: the request went away).
        """
        choice = self.ranks
        outcome: str | None = None
        try:
            if counts:
                with choice.rank_leg(engine, rank):
                    result = await call
            else:
                result = await call
            outcome = rank_outcome(None)
            choice.rank_answered(engine, rank)
            return result
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            outcome = rank_outcome(exc)
            if outcome == "failed" and isinstance(
                    exc, (PrefillFailed, DecodeFailed, DeadlineExceeded)):
                choice.rank_failed(engine, rank)
            raise
        finally:
            if self._on_rank_leg is not None and outcome is not None:
                count = self._rank_counts.get((leg, rank, outcome))
                if count is None:
                    count = self._rank_counts[leg, rank, outcome] = self._on_rank_leg(
                        leg, rank, outcome)
                count.inc()

    def _post(self, leg: PrefillLeg,
              who: str | PrefillTarget) -> Coroutine[Any, Any, dict[str, Any]]:
        if not leg.trace.active:
            return post_prefill(
                self.session, leg.url, leg.body, leg.headers, timeout_s=leg.timeout_s,
                max_bytes=self._max_prefill_bytes, server_hostname=leg.server_hostname,
                who=who,
            )
        return self._traced_post(leg, who)

    async def _traced_post(self, leg: PrefillLeg, who: str | PrefillTarget) -> dict[str, Any]:
        with leg.trace.span(PREFILL_SPAN, client=True, attributes=_target(leg.url)) as span:
            return await post_prefill(
                self.session, leg.url, leg.body, span.headers(leg.headers),
                timeout_s=leg.timeout_s, max_bytes=self._max_prefill_bytes,
                server_hostname=leg.server_hostname, span=span, who=who,
            )

    async def post_local(
        self, path: str, body: Mapping[str, Any], headers: Mapping[str, str], *, max_bytes: int
    ) -> dict[str, Any]:
        """POST a small JSON call to the local engine and return its answer."""
        return await post_prefill(
            self.session, self.engine_url + path, body, headers,
            timeout_s=self._connect_timeout_s, max_bytes=max_bytes, who=LOCAL_ENGINE,
        )

    # -- decode -----------------------------------------------------------------------------

    def open_decode(
        self,
        route: Route,
        body: Mapping[str, Any] | bytes,
        headers: Mapping[str, str],
        trace: RequestTrace = NOOP_TRACE,
        rank: int | None = None,
    ) -> Awaitable[UpstreamResponse]:
        """POST the decode body to the local engine; the response once its head arrived
        (traced: in its span, which ends when the head arrives; the relay's follows it).
        ``rank``: the local engine's data-parallel rank it runs on (a failed opening cools it
        down; the flow counts the stream in flight there until the request ends)."""
        call: Awaitable[UpstreamResponse]
        if not trace.active:
            call = open_decode(self.session, self.engine_url + route.value, body, headers)
        else:
            call = self._traced_open_decode(route, body, headers, trace)
        if rank is None:
            return call
        return self._ranked("decode", LOCAL, rank, call, counts=False)

    async def _traced_open_decode(
        self,
        route: Route,
        body: Mapping[str, Any] | bytes,
        headers: Mapping[str, str],
        trace: RequestTrace,
    ) -> UpstreamResponse:
        with trace.span(DECODE_FIRST_BYTE_SPAN, client=True) as span:
            return await open_decode(
                self.session, self.engine_url + route.value, body, span.headers(headers), span
            )

    def open_on(
        self,
        engine: Engine,
        route: Route,
        body: Mapping[str, Any] | bytes,
        headers: Mapping[str, str],
        trace: RequestTrace = NOOP_TRACE,
    ) -> Awaitable[UpstreamResponse]:
        """POST a whole request to ``engine`` (None: the local engine; else a prefill target or
        a migration engine, reached as a prefill leg would be); the response once its head
        arrived. Its failures name the engine as a moved request's (never a target's address,
        which a client's answer must not carry)."""
        if engine is LOCAL:
            return self.open_decode(route, body, headers, trace)
        url = self.prefill_url(engine, route)
        if not trace.active:
            return open_decode(self.session, url, body, headers,
                               server_hostname=engine.tls_name, who=MOVED_ENGINE,
                               answering=MOVED_ENGINE)
        return self._traced_open_on(engine, url, body, headers, trace)

    async def _traced_open_on(self, engine: PrefillTarget, url: str,
                              body: Mapping[str, Any] | bytes, headers: Mapping[str, str],
                              trace: RequestTrace) -> UpstreamResponse:
        with trace.span(DECODE_FIRST_BYTE_SPAN, client=True, attributes=_target(url)) as span:
            return await open_decode(self.session, url, body, span.headers(headers), span,
                                     server_hostname=engine.tls_name, who=MOVED_ENGINE,
                                     answering=MOVED_ENGINE)

    async def post_engine(self, engine: Engine, path: str, body: Mapping[str, Any], *,
                          max_bytes: int) -> dict[str, Any]:
        """POST a small JSON call to ``engine`` (None: the local engine) within the connect
        timeout; its JSON object answer (``PrefillFailed`` otherwise, as for a prefill)."""
        if engine is LOCAL:
            return await self.post_local(path, body, _JSON_HEADERS, max_bytes=max_bytes)
        return await post_prefill(
            self.session, engine.base_url + path, body, _JSON_HEADERS,
            timeout_s=self._connect_timeout_s, max_bytes=max_bytes,
            server_hostname=engine.tls_name, who=MOVED_ENGINE,
        )

    async def passthrough(
        self,
        method: str,
        path_qs: str,
        headers: list[tuple[str, str]],
        body: AsyncIterable[bytes] | None,
        content_length: int | None,
    ) -> UpstreamResponse:
        """Forward a request the sidecar does not disaggregate to the local engine."""
        try:
            return await self.session.request(
                method, self.engine_url + path_qs, headers=headers, body=body,
                content_length=content_length,
            )
        except UpstreamTLSError as exc:
            raise DecodeFailed(connect_failure(exc, LOCAL_ENGINE), stage=Stage.DECODE) from None
        except UpstreamConnectError as exc:
            raise EngineNotReady(connect_failure(exc, LOCAL_ENGINE)) from None
        except UpstreamError as exc:
            raise DecodeFailed(broken_connection(exc, LOCAL_ENGINE), stage=Stage.DECODE) from None
        except TimeoutError:
            raise DecodeFailed("local engine did not answer in time", stage=Stage.DECODE) from None

    # -- what dialects ask for --------------------------------------------------------------

    def abort(self, path: str, body: Mapping[str, Any], target: PrefillTarget) -> None:
        """POST a dialect's abort call to the local engine and to ``target``, in the
        background, within the connect timeout (closing a connection is not enough for an
        engine that notices a gone client only when it next writes)."""
        for base, tls_name in ((self.engine_url, None), (target.base_url, target.tls_name)):
            task = asyncio.ensure_future(self._post_abort(base + path, body, tls_name))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)

    async def close(self) -> None:
        """Cancel the abort calls still running and wait for them (server stop)."""
        await cancel_and_wait(*self._aborts)

    async def _post_abort(self, url: str, body: Mapping[str, Any],
                          tls_name: str | None = None) -> None:
        with contextlib.suppress(UpstreamError, TimeoutError):
            async with asyncio.timeout(self._connect_timeout_s):
                response = await self.session.request(
                    "POST", url, headers=_JSON_HEADERS, body=jsonutil.dumps(body),
                    server_hostname=tls_name,
                )
                async with response:
                    await response.read(_MAX_ABORT_ANSWER)

    async def get(self, url: str, *, max_bytes: int) -> tuple[int, bytes]:
        """A dialect's side-channel GET (``EngineLookup``), within the connect timeout."""
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                async with await self.session.get(url) as response:
                    return response.status, await response.read(max_bytes)
        except (UpstreamError, TimeoutError):
            raise LookupFailed(url) from None


def engine_fault(error: SidecarError) -> bool:
    """Whether a failed prefill leg shows its engine unhealthy (its breaker counts it)."""
    if isinstance(error, DeadlineExceeded):
        return True
    return isinstance(error, PrefillFailed) and error.engine_fault


def _target(url: str) -> dict[str, AttributeValue]:
    """The prefill engine's address as leg span attributes (the URL's host and port)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", url_port(parts)
    return {SERVER_ADDRESS: host, SERVER_PORT: port,
            PREFILL_TARGET: f"[{host}]:{port}" if ":" in host else f"{host}:{port}"}


def make_session(settings: Settings) -> EngineClient:
    """The process-wide upstream client; create it inside the running event loop."""
    # No engine_ca_file nor client certificate: the system store, loaded at the first https.
    ssl_context = (
        client_ssl_context(settings.engine_ca_file, settings.engine_client_cert_file,
                           settings.engine_client_key_file)
        if settings.engine_ca_file or settings.engine_client_cert_file else None
    )
    return EngineClient(limit=settings.max_connections, keepalive_s=settings.keepalive_s,
                        connect_timeout_s=settings.connect_timeout_s,
                        read_timeout_s=settings.read_timeout_s, ssl_context=ssl_context)


def with_headers(headers: Mapping[str, str], extra: Mapping[str, str]) -> Mapping[str, str]:
    """``headers`` with ``extra`` set over them (case-insensitive); ``headers`` itself when
    ``extra`` is empty (a leg without them takes the very headers it took before)."""
    if not extra:
        return headers
    out: CIMultiDict[str] = CIMultiDict(headers)
    for name, value in extra.items():
        out[name] = value
    return out
