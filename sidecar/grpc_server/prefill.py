"""``disagg.PrefillWorker/Prefill`` in native hand-off mode: the local engine prefills, the
stream carries the hand-off.

    PreFillRequest ─checks─▶ client body {"model", "prompt": ids, "max_tokens", "temperature", ...}
      ─orchestrator.context (ids: int32 room, disagg id, transfer id, engine id)─▶ ctx
      sequential (vLLM shfs/nixl, TRT-LLM):  POST prefill ─▶ handler.handoff(response)
      concurrent (SGLang, vLLM Mooncake):    handler.handoff(None) at once; the engine call runs
                                             in a watched background task
      ─encode_handoff─▶ KVBlockStream{block: layer -1 ...} ... KVBlockStream{done: true}

The prefill body is built by the same handler and agent as HTTP, from a synthetic client body
on ``/v1/completions``. The hand-off names this pod by ``advertise_host``
(``resolve_advertise_host``): decode engines connect to it (NIXL side channel, SGLang and
Mooncake bootstrap servers).

Concurrent flows: SGLang's prefill blocks until its decode connects, so Prefill cannot wait
for it (the router calls Decode only after Prefill's ``done``). The engine call goes on in a
background task bounded by ``prefill_timeout_s``, holding the request's admission slot (drain
waits for it) and its bootstrap room, logged and counted (``disagg_errors`` with
``front_door="grpc"``) when it fails; ``close()`` cancels what is left at server stop.

Deliberate limits: a failed background prefill cannot abort the decode, which runs on another
sidecar: that decode waits for its engine's bootstrap timeout. When TensorRT-LLM's context
response already is the whole answer (its first token ended the sequence), the hand-off has
no fields, so the decode engine recomputes the prompt; this is counted as a prefill fallback
with reason ``answered_by_prefill``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Final
from urllib.parse import urlsplit

import grpc

from sidecar.core.legs import post_prefill
from sidecar.errors import FailedPrecondition, SidecarError, Stage
from sidecar.grpc_gen import disagg_pb2, disagg_pb2_grpc
from sidecar.grpc_server.bookkeeping import FRONT_DOOR, RpcScope
from sidecar.grpc_server.checks import (
    check_max_new_tokens,
    check_temperature,
    check_token_ids,
    request_id_or_new,
)
from sidecar.grpc_server.engine_model import EngineModel
from sidecar.grpc_server.token_stream import token_id_fields
from sidecar.handoff_codec import encode_handoff
from sidecar.protocol.context import HandoffContext, PrefillTarget, Route
from sidecar.protocol.hostfmt import is_loopback_host
from sidecar.runtime import Runtime
from sidecar.settings import Role, Settings

logger = logging.getLogger(__name__)

METHOD: Final = "/disagg.PrefillWorker/Prefill"
REQUEST_ID_HEADER: Final = "X-Request-Id"
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}


def resolve_advertise_host(settings: Settings) -> str | None:
    """The host decode engines use to reach this pod's engine, or None when unknown.

    ``advertise_host`` (flag, env or POD_IP) wins, loopback included (an operator who runs
    both pods on one host says so explicitly). Without it, the engine URL's host serves when
    it is not loopback. A loopback engine URL and no advertise host: None, and Prefill refuses
    with FAILED_PRECONDITION rather than hand decode an address that points at itself.
    """
    if settings.advertise_host:
        return settings.advertise_host
    host = urlsplit(settings.engine_url).hostname or ""
    return None if is_loopback_host(host) else host


def engine_target(settings: Settings, host: str) -> PrefillTarget:
    """This pod's engine as the hand-off names it: ``host`` and the engine URL's port."""
    parts = urlsplit(settings.engine_url)
    return PrefillTarget(host, parts.port or _DEFAULT_PORTS.get(parts.scheme, 80))


class PrefillService(disagg_pb2_grpc.PrefillWorkerServicer):
    """Runs the local engine's prefill leg and streams its hand-off."""

    def __init__(self, runtime: Runtime, model: EngineModel) -> None:
        self._runtime = runtime
        self._model = model
        self._orchestrator = runtime.grpc_orchestrator
        self._advertise_host = resolve_advertise_host(runtime.settings)
        self._url = self._orchestrator.engine_url(Route.COMPLETIONS)
        self._background: set[asyncio.Task[None]] = set()
        if self._advertise_host is None and runtime.settings.role is not Role.DECODE:
            logger.warning(
                "gRPC Prefill is refused (FAILED_PRECONDITION) until --advertise-host (or "
                "POD_IP) is set: the engine URL %s is loopback, which decode pods cannot reach",
                runtime.settings.engine_url,
            )

    @property
    def background_tasks(self) -> frozenset[asyncio.Task[None]]:
        """Concurrent prefill engine calls still running (for tests and shutdown)."""
        return frozenset(self._background)

    async def Prefill(
        self,
        request: disagg_pb2.PreFillRequest,
        context: grpc.aio.ServicerContext[disagg_pb2.PreFillRequest, disagg_pb2.KVBlockStream],
    ) -> AsyncIterator[disagg_pb2.KVBlockStream]:
        scope = RpcScope(self._runtime, METHOD, request.request_id or "-")
        async with scope.serving(context):
            scope.admit()
            messages = await self._handoff_messages(request, scope, context.time_remaining())
            kv_out = self._runtime.metrics.kv_bytes.labels("out")
            for message, nbytes in messages:
                kv_out.inc(nbytes)
                yield message
            # Counted before the last yield: a router may hang up as soon as it has ``done``.
            scope.outcome = "ok"
            yield disagg_pb2.KVBlockStream(done=True)

    async def _handoff_messages(
        self, request: disagg_pb2.PreFillRequest, scope: RpcScope, time_remaining: float | None
    ) -> list[tuple[disagg_pb2.KVBlockStream, int]]:
        """The stream's block messages, each with its K+V byte count (the ``kv_bytes`` metric)."""
        blocks = await self._handoff_blocks(request, scope, time_remaining)
        return [
            (disagg_pb2.KVBlockStream(block=block), len(block.k_data) + len(block.v_data))
            for block in blocks
        ]

    async def _handoff_blocks(
        self, request: disagg_pb2.PreFillRequest, scope: RpcScope, time_remaining: float | None
    ) -> list[disagg_pb2.KVBlock]:
        token_ids = check_token_ids(request.token_ids)
        max_new_tokens = check_max_new_tokens(request.max_new_tokens, allow_unset=True)
        temperature = check_temperature(request.temperature)
        if self._advertise_host is None:
            raise FailedPrecondition(
                "this sidecar has no advertise host (set --advertise-host or POD_IP); its "
                "engine URL is loopback, which a decode engine cannot reach",
                stage=Stage.PREFILL,
            )
        request_id = request_id_or_new(request.request_id)
        runtime = self._runtime
        client_body: dict[str, Any] = {
            "model": await self._model.name(),
            "prompt": token_ids,
            "max_tokens": max_new_tokens or 1,
            "temperature": temperature,
            **token_id_fields(runtime.engine_name),
        }
        target = engine_target(runtime.settings, self._advertise_host)
        ctx = await self._orchestrator.context(
            Route.COMPLETIONS, request_id, target, self._advertise_host
        )
        headers = {REQUEST_ID_HEADER: request_id}
        handed_off = False
        try:
            prefill_body = runtime.handler.prefill_body(client_body, ctx, runtime.agent)
            if self._orchestrator.concurrent:
                fields = runtime.handler.handoff(None, ctx, runtime.agent)
                self._start_background(prefill_body, headers, ctx, scope.detach())
                handed_off = True
            else:
                fields = await self._sequential(prefill_body, headers, ctx, scope, time_remaining)
        finally:
            if not handed_off:
                self._orchestrator.release(ctx)
        return encode_handoff(
            fields,
            request_id=request_id,
            engine=runtime.engine_name,
            kv_connector=runtime.agent.name if runtime.agent is not None else None,
            prefill_host=target.host,
            prefill_port=target.port,
        )

    async def _sequential(
        self,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        ctx: HandoffContext,
        scope: RpcScope,
        time_remaining: float | None,
    ) -> dict[str, Any]:
        runtime = self._runtime
        timeout_s = runtime.settings.prefill_timeout_s
        if time_remaining is not None:
            # The caller's deadline bounds the engine call too (grpc cancels us at it anyway).
            timeout_s = max(min(timeout_s, time_remaining), 0.001)
        started = time.perf_counter()
        response = await post_prefill(
            runtime.session, self._url, body, headers, timeout_s=timeout_s,
            max_bytes=runtime.settings.max_prefill_response_bytes,
        )
        scope.observe("prefill", time.perf_counter() - started)
        if runtime.handler.answered_by_prefill(response):
            runtime.metrics.prefill_fallbacks.labels(FRONT_DOOR, "answered_by_prefill").inc()
            logger.info("request %s: the prefill finished the sequence; decode recomputes",
                        ctx.request_id)
            return {}
        handoff_started = time.perf_counter()
        fields = runtime.handler.handoff(response, ctx, runtime.agent)
        scope.observe("handoff", time.perf_counter() - handoff_started)
        return fields

    def _start_background(
        self,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        ctx: HandoffContext,
        release_admission: Callable[[], None],
    ) -> None:
        task = asyncio.ensure_future(self._watch(body, headers, ctx, release_admission))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _watch(
        self,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        ctx: HandoffContext,
        release_admission: Callable[[], None],
    ) -> None:
        """The concurrent engine prefill: awaited here, never by the RPC."""
        runtime = self._runtime
        started = time.perf_counter()
        try:
            await post_prefill(
                runtime.session, self._url, body, headers,
                timeout_s=runtime.settings.prefill_timeout_s,
                max_bytes=runtime.settings.max_prefill_response_bytes,
            )
            runtime.metrics.stage_seconds.labels(FRONT_DOOR, "prefill").observe(
                time.perf_counter() - started
            )
        except SidecarError as error:
            runtime.metrics.errors.labels(FRONT_DOOR, error.stage.value, error.code).inc()
            logger.warning("request %s: background prefill failed after the hand-off: %s (%s)",
                           ctx.request_id, error.code, error.message)
        except asyncio.CancelledError:
            logger.info("request %s: background prefill cancelled", ctx.request_id)
            raise
        except Exception:
            runtime.metrics.errors.labels(FRONT_DOOR, Stage.PREFILL.value, "internal_error").inc()
            logger.exception("request %s: background prefill crashed", ctx.request_id)
        finally:
            self._orchestrator.release(ctx)
            release_admission()

    async def close(self) -> None:
        """Cancel the background prefills still running (server stop)."""
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
