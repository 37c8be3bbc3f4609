"""``disagg.PrefillWorker/Prefill`` in inline mode (``--kv-transport inline``): the real KV.

    PreFillRequest ─checks─▶ metadata announced from <kv_staging_dir>/engine.json
      ─▶ bind <kv_staging_dir>/.K.notify, then in a task: POST /v1/completions {"prompt": ids,
         "max_tokens": 1, "kv_transfer_params": {"disagg_inline": {"action": "save", "key": K}}}
      ─▶ KVBlock{layer -2: metadata}                      at once, before the engine computes
      ─▶ KVBlock{layer l, block 0..n-1} per layer l       as the connector finishes layer l
                                                          (file K/layer-l.kv + a notice)
      ─▶ engine answered: K/meta.json must equal the announced metadata, then the layers not
         yet sent, from their files ─▶ done
      ─▶ K/ and .K.notify removed, the engine call ended (always: success, failure, cancel)

How a layer is known to be complete: ``sidecar.inline_kv.layer_watch`` (a Unix datagram per
layer from the connector; why that and not inotify is said there). A notice only wakes the
stream, which then sends the next layer in order if its file is there (files appear under
their final name only complete); lost or absent notices merely delay layers to the engine's
answer, after which every layer not yet sent is read from its file. So an engine that writes
the files without notifying (the benchmark's stub) still works, with the stream starting at
its answer.

Without a usable ``engine.json`` (no connector has started on this staging directory yet) the
metadata cannot be announced: the stream then starts once the engine has answered, from
``meta.json``, as a whole.

Errors: KV over ``max_staged_bytes`` -> RESOURCE_EXHAUSTED before the engine is called (or,
without ``engine.json``, after); no ``meta.json``, a missing or wrongly sized layer file, a
``meta.json`` that disagrees with the announced metadata -> FAILED_PRECONDITION (the engine
is not running this project's connector on this staging directory, or changed
configuration); engine failures as in native mode. An error after blocks were sent ends the
stream with that status and no ``done``: a router never mistakes a partial stream for KV.

This handler is a coroutine that writes with ``context.write``, not an async generator: a
cancelled RPC raises ``CancelledError`` in this frame wherever it waits, so the engine call
is cancelled (closing its connection, which makes vLLM abort the request) and the staged
files removed before the RPC's bookkeeping ends (an abandoned generator would only be
closed later by the garbage collector).

Deliberate limits: one layer's blocks are held in memory at a time; an engine whose saving
step is already running when the RPC is cancelled may write its files after they were
removed (vLLM cannot abort a forward pass in progress): ``active_keys`` names the requests in
flight, and ``sidecar.inline_kv.orphans`` removes such late directories once they are old.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from connectors.inline_layout import InlineMeta
from sidecar.core.legs import post_prefill
from sidecar.errors import FailedPrecondition, ResourceExhausted, Stage
from sidecar.grpc_gen import disagg_pb2
from sidecar.grpc_server.bookkeeping import RpcScope
from sidecar.grpc_server.checks import check_temperature, check_token_ids, request_id_or_new
from sidecar.grpc_server.engine_model import EngineModel
from sidecar.grpc_server.prefill import METHOD, REQUEST_ID_HEADER, PrefillService
from sidecar.inline_kv.codec import meta_block, read_staged_meta
from sidecar.inline_kv.layer_watch import LayerNotices
from sidecar.inline_kv.prefill_files import (
    announced_meta,
    read_layer_messages,
    ready_layer_messages,
)
from sidecar.runtime import Runtime

logger = logging.getLogger(__name__)
PARAMS_KEY = "disagg_inline"

#: Sends one stream message and counts its K+V bytes.
Send = Callable[[disagg_pb2.KVBlockStream, int], Awaitable[None]]
Context = grpc.aio.ServicerContext[disagg_pb2.PreFillRequest, disagg_pb2.KVBlockStream]


class InlinePrefillService(PrefillService):
    """Prefill whose stream carries the engine's KV cache (see the module docstring)."""

    def __init__(self, runtime: Runtime, model: EngineModel) -> None:
        super().__init__(runtime, model)
        #: Staging keys of the Prefills in flight (the orphan sweep leaves them alone).
        self.active_keys: set[str] = set()

    # A coroutine handler, not the base's async generator: see the module docstring.
    async def Prefill(  # type: ignore[override]
        self, request: disagg_pb2.PreFillRequest, context: Context
    ) -> None:
        scope = RpcScope(self._runtime, METHOD, request.request_id or "-")
        kv_out = self._runtime.metrics.kv_bytes.labels("out")

        async def send(message: disagg_pb2.KVBlockStream, nbytes: int) -> None:
            kv_out.inc(nbytes)
            await context.write(message)

        async with scope.serving(context):
            scope.admit()
            await self._stream(request, scope, context.time_remaining(), send)
            # Counted before the last write: a router may hang up as soon as it has ``done``.
            scope.outcome = "ok"
            await context.write(disagg_pb2.KVBlockStream(done=True))

    async def _stream(
        self,
        request: disagg_pb2.PreFillRequest,
        scope: RpcScope,
        time_remaining: float | None,
        send: Send,
    ) -> None:
        settings = self._runtime.settings
        token_ids = check_token_ids(request.token_ids)
        check_temperature(request.temperature)
        request_id = request_id_or_new(request.request_id)
        root = Path(settings.kv_staging_dir)
        key = f"p-{uuid.uuid4().hex}"
        announced = announced_meta(root, key, len(token_ids))
        if announced is not None:
            self._check_bound(announced.layout.num_layers * announced.num_blocks
                              * announced.layout.block_bytes)
        body: dict[str, Any] = {
            "model": await self._model.name(),
            "prompt": token_ids,
            # One token: the KV of the prompt is what is wanted; decode generates the rest.
            "max_tokens": 1,
            "temperature": 0.0,
            "kv_transfer_params": {PARAMS_KEY: {"action": "save", "key": key}},
        }
        timeout_s = settings.prefill_timeout_s
        if time_remaining is not None:
            timeout_s = max(min(timeout_s, time_remaining), 0.001)
        self.active_keys.add(key)
        try:
            await self._stream_key(request_id, root, key, announced, body, timeout_s, scope,
                                   send)
        finally:
            self.active_keys.discard(key)

    async def _stream_key(
        self,
        request_id: str,
        root: Path,
        key: str,
        announced: InlineMeta | None,
        body: dict[str, Any],
        timeout_s: float,
        scope: RpcScope,
        send: Send,
    ) -> None:
        directory = root / key
        # Bound before the engine is called: no notice can come before the listener.
        with LayerNotices(root, key) as notices:
            engine = asyncio.ensure_future(self._prefill(body, request_id, timeout_s, scope))
            engine.add_done_callback(lambda _: notices.wake())
            try:
                sent = 0
                if announced is not None:
                    head = meta_block(request_id, announced)
                    await send(disagg_pb2.KVBlockStream(block=head), len(head.k_data))
                    sent = await self._while_computing(
                        request_id, announced, directory, notices, engine, send
                    )
                await engine  # the engine's errors end the stream here
                await self._after_answer(request_id, announced, directory, sent, send)
            finally:
                try:
                    await _settle(engine)
                finally:
                    # Synchronous on tmpfs: no cancellation can skip it.
                    shutil.rmtree(directory, ignore_errors=True)

    async def _after_answer(
        self,
        request_id: str,
        announced: InlineMeta | None,
        directory: Path,
        sent: int,
        send: Send,
    ) -> None:
        """The engine answered: check its meta.json, send the layers not sent yet."""
        meta = read_staged_meta(directory)
        if announced is None:
            self._check_bound(meta.layout.num_layers * meta.num_blocks * meta.layout.block_bytes)
            head = meta_block(request_id, meta)
            await send(disagg_pb2.KVBlockStream(block=head), len(head.k_data))
        elif meta != announced:
            raise FailedPrecondition(
                f"the prefill engine saved KV as {meta.to_dict()}, not as announced from its "
                f"engine.json ({announced.to_dict()})",
                stage=Stage.PREFILL,
            )
        for layer_idx in range(sent, meta.layout.num_layers):
            messages = await asyncio.to_thread(
                read_layer_messages, request_id, meta, directory, layer_idx
            )
            await _send_layer(messages, meta.layout.tile_bytes, send)

    async def _while_computing(
        self,
        request_id: str,
        meta: InlineMeta,
        directory: Path,
        notices: LayerNotices,
        engine: asyncio.Future[None],
        send: Send,
    ) -> int:
        """Send, in order, the layers finished before the engine answered; return how many."""
        sent = 0
        while sent < meta.layout.num_layers and not engine.done():
            # A notice for this layer or a later one: the connector writes layers in order.
            if notices.highest >= sent:
                found = await asyncio.to_thread(
                    ready_layer_messages, request_id, meta, directory, sent
                )
                if found is not None:
                    await _send_layer(found, meta.layout.tile_bytes, send)
                    sent += 1
                    continue
            await notices.wait()
        return sent

    async def _prefill(
        self, body: dict[str, Any], request_id: str, timeout_s: float, scope: RpcScope
    ) -> None:
        started = time.perf_counter()
        await post_prefill(
            self._runtime.session,
            self._url,
            body,
            {REQUEST_ID_HEADER: request_id},
            timeout_s=timeout_s,
            max_bytes=self._runtime.settings.max_prefill_response_bytes,
        )
        scope.observe("prefill", time.perf_counter() - started)

    def _check_bound(self, nbytes: int) -> None:
        limit = self._runtime.settings.max_staged_bytes
        if nbytes > limit:
            raise ResourceExhausted(
                f"the request's KV is {nbytes} bytes, over max_staged_bytes {limit}",
                stage=Stage.PREFILL,
            )


async def _send_layer(
    messages: list[disagg_pb2.KVBlockStream], tile_bytes: int, send: Send
) -> None:
    for message in messages:
        await send(message, 2 * tile_bytes)


async def _settle(task: asyncio.Future[None]) -> None:
    """End ``task`` (cancelled if still running) and wait for it, raising nothing of its own."""
    if not task.done():
        task.cancel()
    # asyncio.wait raises neither the task's error nor its cancellation; ours still propagates.
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # retrieved: raised above already, or moot after another error
