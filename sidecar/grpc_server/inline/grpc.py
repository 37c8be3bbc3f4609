"""The inline KV transport over gRPC (``--kv-transport inline``): the KV cache in the stream.

    Prefill (``InlinePrefill``): metadata announced from <kv_staging_dir>/engine.json
      ─▶ the engine's prefill (the inline dialect's body: save under key K) in a task
      ─▶ KVBlock{layer -2: metadata} at once, then each layer's runs of pages as the
         connector finishes it (file K/layer-l.kv + a notice, ``layer_watch``), the rest
         once the engine answered and K/meta.json equals the announced metadata; K removed
    Decode (``InlineDecode``): the request's wire bytes walked (``protowire``: tiles are
      memoryviews into the request) ─▶ checked (``wire``) against <kv_staging_dir>/
      engine.json ─▶ staged (``staging``, within max_staged_bytes) ─▶ the inline dialect's
      decode body (load K): the engine's SidecarKVConnector loads the staged blocks

The order, timing and every error of both directions are the contract's: protos/README.md
("layer_idx -2"). A notice only wakes the stream, which sends the next layer in order if its
file is complete (lost notices delay layers to the engine's answer); the decode walks the wire
bytes to hold the KV once (docs/extending/design-notes.md#layer-notices, #decode-wire-walk).

Deliberate limits: one layer's blocks are in memory at a time on the prefill side; an engine
already saving when the RPC is cancelled writes its files after their removal (a forward pass
cannot be aborted): ``orphans`` removes them once old (``active_keys``: requests in flight).
The decode cannot check ``token_ids`` against the KV's prompt; it refuses KV of more tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from google.protobuf.message import DecodeError

from connectors.inline_layout import InlineMeta, LayoutError, read_engine_layout
from sidecar.config.settings import Settings
from sidecar.dialects import InlineDialect
from sidecar.engines.calls import PrefillLeg
from sidecar.errors import FailedPrecondition, InvalidRequest, ResourceExhausted, Stage
from sidecar.grpc_gen import disagg_pb2
from sidecar.grpc_server.decode import DecodeInput
from sidecar.grpc_server.inline.layer_watch import LayerNotices
from sidecar.grpc_server.inline.prefill_files import (
    LayerMessage,
    announced_meta,
    pages_per_block,
    read_layer_messages,
    read_staged_meta,
    ready_layer_messages,
)
from sidecar.grpc_server.inline.protowire import WireError, split_decode_request
from sidecar.grpc_server.inline.staging import StagingArea
from sidecar.grpc_server.inline.wire import (
    check_compatible,
    meta_block,
    parse_blocks,
    parse_entries,
)
from sidecar.grpc_server.prefill import PrefillCall, Send, engine_target
from sidecar.grpc_server.rpc import (
    Malformed,
    check_max_new_tokens,
    check_temperature,
    check_token_ids,
)
from sidecar.observability.metrics import Metrics
from sidecar.protocol.context import FrontDoor, HandoffContext, Route
from sidecar.protocol.request import REQUEST_ID_HEADER, request_id_or_new
from sidecar.request.runner import Runner
from sidecar.request.scope import RequestScope

#: Bytes of a stream message besides its K and V: the request id and the framing.
_MESSAGE_SLACK = 4096


class InlinePrefill:
    """Prefill whose stream carries the engine's KV cache (see the module docstring)."""

    def __init__(self, flow: Runner, settings: Settings) -> None:
        self._flow = flow
        self._dialect = _inline_dialect(flow)
        self._settings = settings
        self._url = flow.calls.local_url(Route.COMPLETIONS)
        self._engine = engine_target(settings, urlsplit(settings.engine_url).hostname or "")
        #: Staging keys of the Prefills in flight (the orphan sweep leaves them alone).
        self.active_keys: set[str] = set()

    async def run(self, call: PrefillCall) -> None:
        request, scope, send = call.request, call.scope, call.send
        settings = self._settings
        token_ids = check_token_ids(request.token_ids)
        check_temperature(request.temperature)
        request_id = request_id_or_new(request.request_id)
        root = Path(settings.kv_staging_dir)
        key = f"p-{uuid.uuid4().hex}"
        announced = announced_meta(root, key, len(token_ids))
        if announced is not None:
            self._check_bound(announced.layout.num_layers * announced.num_blocks
                              * announced.layout.block_bytes)
        ctx = self._dialect.keyed(HandoffContext(
            Route.COMPLETIONS, request_id, self._engine, self._engine.host, FrontDoor.GRPC,
            prefill_rank=self._flow.ranks.local(call.rank),
        ), key)
        client_body = {"model": await self._flow.calls.model_name(Stage.PREFILL),
                       "prompt": token_ids}
        leg = PrefillLeg(
            url=self._url,
            body=self._dialect.prefill_body(client_body, ctx),
            headers={REQUEST_ID_HEADER: request_id, **self._dialect.prefill_headers(ctx)},
            timeout_s=self._flow.prefill_timeout(call.time_remaining),
            trace=scope.trace,
            rank=ctx.prefill_rank,
        )
        self.active_keys.add(key)
        try:
            await self._stream_key(request_id, root / key, root, key, announced, leg, scope, send)
        finally:
            self.active_keys.discard(key)

    async def _stream_key(
        self,
        request_id: str,
        directory: Path,
        root: Path,
        key: str,
        announced: InlineMeta | None,
        leg: PrefillLeg,
        scope: RequestScope,
        send: Send,
    ) -> None:
        # Bound before the engine is called: no notice can come before the listener.
        with LayerNotices(root, key) as notices:
            engine = asyncio.ensure_future(self._engine_call(leg, scope))
            engine.add_done_callback(lambda _: notices.wake())
            try:
                sent = 0
                if announced is not None:
                    wire = self._wire_meta(announced)
                    head = meta_block(request_id, wire)
                    await send(disagg_pb2.KVBlockStream(block=head), len(head.k_data))
                    sent = await self._while_computing(
                        request_id, wire, directory, notices, engine, send
                    )
                await engine  # the engine's errors end the stream here
                await self._after_answer(request_id, announced, directory, sent, send)
            finally:
                try:
                    await _settle(engine)
                finally:
                    # Synchronous on tmpfs: no cancellation can skip it.
                    shutil.rmtree(directory, ignore_errors=True)

    async def _engine_call(self, leg: PrefillLeg, scope: RequestScope) -> None:
        started = time.perf_counter()
        await self._flow.calls.post_prefill(leg)
        scope.observe("prefill", time.perf_counter() - started)

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
        wire = self._wire_meta(meta)
        if announced is None:
            self._check_bound(meta.layout.num_layers * meta.num_blocks * meta.layout.block_bytes)
            head = meta_block(request_id, wire)
            await send(disagg_pb2.KVBlockStream(block=head), len(head.k_data))
        elif meta != announced:
            raise FailedPrecondition(
                f"the prefill engine saved KV as {meta.to_dict()}, not as announced from its "
                f"engine.json ({announced.to_dict()})",
                stage=Stage.PREFILL,
            )
        for layer_idx in range(sent, meta.layout.num_layers):
            messages = await asyncio.to_thread(
                read_layer_messages, request_id, wire, directory, layer_idx
            )
            await _send_layer(messages, send)

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
                    await _send_layer(found, send)
                    sent += 1
                    continue
            await notices.wait()
        return sent

    def _wire_meta(self, meta: InlineMeta) -> InlineMeta:
        """``meta`` as streamed: runs of as many pages as fit ``kv_block_bytes``, and the gRPC
        message limit whatever ``kv_block_bytes`` says (a message also carries the ids)."""
        settings = self._settings
        budget = min(settings.kv_block_bytes, settings.grpc_max_message_bytes - _MESSAGE_SLACK)
        return dataclasses.replace(meta, pages_per_block=pages_per_block(meta, budget))

    def _check_bound(self, nbytes: int) -> None:
        limit = self._settings.max_staged_bytes
        if nbytes > limit:
            raise ResourceExhausted(
                f"the request's KV is {nbytes} bytes, over max_staged_bytes {limit}",
                stage=Stage.PREFILL,
            )


async def _send_layer(messages: list[LayerMessage], send: Send) -> None:
    for message, kv_bytes in messages:
        await send(message, kv_bytes)


async def _settle(task: asyncio.Future[None]) -> None:
    """End ``task`` (cancelled if still running) and wait for it, raising nothing of its own."""
    if not task.done():
        task.cancel()
    # asyncio.wait raises neither the task's error nor its cancellation; ours still propagates.
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # retrieved: raised above already, or moot after another error


class InlineDecode:
    """Decode from KV bytes carried in the request (see the module docstring)."""

    #: The request's bytes as they came: walked here, without protobuf objects for the KV.
    raw_request = True

    def __init__(self, flow: Runner, settings: Settings, area: StagingArea,
                 metrics: Metrics) -> None:
        self._flow = flow
        self._dialect = _inline_dialect(flow)
        self._engine = engine_target(settings, urlsplit(settings.engine_url).hostname or "")
        self._max_blocks = settings.max_kv_blocks
        self.staging = area
        self._kv_in = metrics.kv_bytes.labels("in")

    def read(self, request: disagg_pb2.DecodeRequest | Malformed | bytes) -> DecodeInput:
        """The request without its blocks, and its blocks; a malformed one becomes an empty
        request and the error, raised in ``decode_body`` so that it is counted and answered
        like every other refusal."""
        if isinstance(request, Malformed):
            return DecodeInput(disagg_pb2.DecodeRequest(), malformed=request.error(Stage.HANDOFF))
        if not isinstance(request, bytes):
            return DecodeInput(request)
        try:
            head, blocks = split_decode_request(request)
            parsed = disagg_pb2.DecodeRequest.FromString(head)
        except (WireError, DecodeError) as exc:
            return DecodeInput(disagg_pb2.DecodeRequest(), malformed=InvalidRequest(
                f"malformed DecodeRequest: {exc}", stage=Stage.HANDOFF
            ))
        return DecodeInput(
            parsed, walked=[(b.layer_idx, b.block_idx, b.k_data, b.v_data) for b in blocks]
        )

    async def decode_body(
        self, decode_input: DecodeInput, exits: contextlib.AsyncExitStack,
        rank: int | None = None,
    ) -> tuple[dict[str, Any], str]:
        if decode_input.malformed is not None:
            raise decode_input.malformed  # first: the empty head says nothing true
        request = decode_input.request
        token_ids = check_token_ids(request.token_ids)
        max_new_tokens = check_max_new_tokens(request.max_new_tokens, allow_unset=False)
        temperature = check_temperature(request.temperature)
        if decode_input.walked is None:
            kv = parse_blocks(request.kv_blocks, max_blocks=self._max_blocks)
        else:
            kv = parse_entries(decode_input.walked, max_blocks=self._max_blocks)
        # From the parsed blocks: summing over request.kv_blocks would copy every tile again.
        self._kv_in.inc(kv.wire_bytes)
        try:
            engine_layout = read_engine_layout(self.staging.root)
        except LayoutError as exc:
            raise FailedPrecondition(str(exc), stage=Stage.HANDOFF) from None
        check_compatible(kv.meta, engine_layout)
        if kv.meta.num_tokens > len(token_ids):
            raise InvalidRequest(
                f"inline KV covers {kv.meta.num_tokens} tokens; the prompt has {len(token_ids)}",
                stage=Stage.HANDOFF,
            )
        request_id = request_id_or_new(request.request_id)
        key = await exits.enter_async_context(self.staging.stage(kv))
        ctx = self._dialect.keyed(HandoffContext(
            Route.COMPLETIONS, request_id, self._engine, self._engine.host, FrontDoor.GRPC
        ), key)
        body: dict[str, Any] = {
            "model": await self._flow.calls.model_name(Stage.DECODE),
            "prompt": token_ids,
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "stream": True,
            **self._dialect.token_id_fields,
        }
        body = self._dialect.decode_body(body, self._dialect.handoff(None, ctx), rank)
        return body, request_id


def _inline_dialect(flow: Runner) -> InlineDialect:
    """The inline transport's dialect: the one its flow must have been built with."""
    if not isinstance(flow.dialect, InlineDialect):
        raise TypeError(f"the inline transport needs the inline dialect, not {flow.dialect!r}")
    return flow.dialect
