"""Every call the core makes to an engine, with its URL, deadline, span and accounting.

    post_prefill(leg)              ─▶ the prefill's JSON answer (a remote target's leg counts as
                                      in flight there; a refused connect cools the target down)
    open_decode(route, body, ...)  ─▶ UpstreamResponse (head arrived, status 200)
    post_local(path, body, ...)    ─▶ a small JSON call to the local engine (its tokenizer)
    passthrough(method, path, ...) ─▶ the local engine's raw response (HTTP passthrough)
    model_name(stage)              ─▶ the local engine's served model (gRPC bodies)
    abort(path, body, target)         a dialect's abort call to both engines, in the background
    get(url, max_bytes=)              a dialect's side-channel lookup (``EngineLookup``)

Only the core talks to engines; this module knows no engine: bodies, paths and abort calls
come from the dialect, through the flow (``sidecar.core.flow``).

Tracing: a call of a traced request runs in its leg span, and that span, not the client's,
is the ``traceparent`` the engine receives. An untraced request (tracing off) takes exactly
the calls it took before tracing existed: the untraced branches hand back the plain call
(no extra coroutine layer, which each resumption of the leg would cross again).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

from opentelemetry.util.types import AttributeValue

from sidecar import jsonutil
from sidecar.core.engine_model import EngineModel
from sidecar.core.legs import open_decode, post_prefill
from sidecar.dialects.base import LookupFailed
from sidecar.errors import DecodeFailed, EngineNotReady, PrefillUnreachable, Stage
from sidecar.http1 import EngineClient, UpstreamConnectError, UpstreamError, UpstreamResponse
from sidecar.observability.tracing import (
    DECODE_FIRST_BYTE_SPAN,
    NOOP_TRACE,
    PREFILL_SPAN,
    PREFILL_TARGET,
    SERVER_ADDRESS,
    SERVER_PORT,
    RequestTrace,
)
from sidecar.protocol.context import PrefillTarget, Route
from sidecar.targets.choice import TargetChoice

#: Prefill URLs remembered per (target, route); cleared whole when full (bounded memory).
_MAX_REMEMBERED_URLS: Final = 4096
_JSON_HEADERS: Final = {"Content-Type": "application/json"}
#: An abort call's answer is a short acknowledgement; it is read only to keep the connection.
_MAX_ABORT_ANSWER: Final = 64 * 1024
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}

#: Counts a finished prefill leg to a remote target: (target label, outcome).
LegCounter = Callable[[str, str], None]


@dataclass(frozen=True, slots=True)
class PrefillLeg:
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
        on_prefill_leg: LegCounter | None = None,
    ) -> None:
        self.session = session
        self.engine_url = engine_url.rstrip("/")
        self._connect_timeout_s = connect_timeout_s
        self._max_prefill_bytes = max_prefill_response_bytes
        self.choice = choice if choice is not None else TargetChoice(cooldown_s=0.0)
        self._on_prefill_leg = on_prefill_leg
        self._aborts: set[asyncio.Task[None]] = set()
        self._prefill_urls: dict[tuple[PrefillTarget, Route], str] = {}
        self._models = {
            stage: EngineModel(session, engine_url, timeout_s=connect_timeout_s, stage=stage)
            for stage in (Stage.PREFILL, Stage.DECODE)
        }

    # -- addresses --------------------------------------------------------------------------

    def local_url(self, route: Route | str) -> str:
        return self.engine_url + str(route)

    def prefill_url(self, target: PrefillTarget, route: Route) -> str:
        """The prefill leg's URL (remembered: formatting it parses the host each time)."""
        key = (target, route)
        url = self._prefill_urls.get(key)
        if url is None:
            if len(self._prefill_urls) >= _MAX_REMEMBERED_URLS:
                self._prefill_urls.clear()
            url = self._prefill_urls[key] = target.base_url + route.value
        return url

    async def model_name(self, stage: Stage) -> str:
        """The local engine's served model name (cached; ``EngineNotReady`` when unknown)."""
        return await self._models[stage].name()

    # -- prefill ----------------------------------------------------------------------------

    async def post_prefill(self, leg: PrefillLeg) -> dict[str, Any]:
        """POST a prefill leg and return its JSON object answer.

        A leg to a remote target counts as in flight there while it runs; a refused connect
        cools the target down (``TargetChoice``).
        """
        post = self._post(leg)
        if leg.target is None:
            return await post
        target = leg.target
        outcome: str | None = "failed"
        try:
            with self.choice.leg(target):
                answer = await post
            outcome = "ok"
            self.choice.answered(target)
            return answer
        except PrefillUnreachable:
            outcome = "connect_refused"
            self.choice.refused(target)
            raise
        except asyncio.CancelledError:
            outcome = None  # the request went away: not the target's doing
            raise
        finally:
            if self._on_prefill_leg is not None and outcome is not None:
                self._on_prefill_leg(self.choice.label(target), outcome)

    def _post(self, leg: PrefillLeg) -> Coroutine[Any, Any, dict[str, Any]]:
        if not leg.trace.active:
            return post_prefill(
                self.session, leg.url, leg.body, leg.headers, timeout_s=leg.timeout_s,
                max_bytes=self._max_prefill_bytes, server_hostname=leg.server_hostname,
            )
        return self._traced_post(leg)

    async def _traced_post(self, leg: PrefillLeg) -> dict[str, Any]:
        with leg.trace.span(PREFILL_SPAN, client=True, attributes=_target(leg.url)) as span:
            return await post_prefill(
                self.session, leg.url, leg.body, span.headers(leg.headers),
                timeout_s=leg.timeout_s, max_bytes=self._max_prefill_bytes,
                server_hostname=leg.server_hostname, span=span,
            )

    async def post_local(
        self, path: str, body: Mapping[str, Any], headers: Mapping[str, str], *, max_bytes: int
    ) -> dict[str, Any]:
        """POST a small JSON call to the local engine and return its answer."""
        return await post_prefill(
            self.session, self.engine_url + path, body, headers,
            timeout_s=self._connect_timeout_s, max_bytes=max_bytes,
        )

    # -- decode -----------------------------------------------------------------------------

    def open_decode(
        self,
        route: Route,
        body: Mapping[str, Any] | bytes,
        headers: Mapping[str, str],
        trace: RequestTrace = NOOP_TRACE,
    ) -> Coroutine[Any, Any, UpstreamResponse]:
        """POST the decode body to the local engine; the response once its head arrived
        (traced: in its span, which ends when the head arrives; the relay's follows it)."""
        if not trace.active:
            return open_decode(self.session, self.engine_url + route.value, body, headers)
        return self._traced_open_decode(route, body, headers, trace)

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
        except UpstreamConnectError:
            raise EngineNotReady("local engine refused the connection") from None
        except (UpstreamError, TimeoutError):
            raise DecodeFailed("local engine broke the connection", stage=Stage.DECODE) from None

    # -- what dialects ask for --------------------------------------------------------------

    def abort(self, path: str, body: Mapping[str, Any], target: PrefillTarget) -> None:
        """POST a dialect's abort call to the local engine and to ``target``, in the
        background, bounded by the connect timeout.

        Closing a connection is not enough for engines that notice a gone client only when
        they next write.
        """
        for base, tls_name in ((self.engine_url, None), (target.base_url, target.tls_name)):
            task = asyncio.ensure_future(self._post_abort(base + path, body, tls_name))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)

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


def _target(url: str) -> dict[str, AttributeValue]:
    """The prefill engine's address as leg span attributes (the URL's host and port)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or _DEFAULT_PORTS.get(parts.scheme, 80)
    return {
        SERVER_ADDRESS: host,
        SERVER_PORT: port,
        PREFILL_TARGET: f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
    }
