"""``disagg.PrefillWorker/Prefill`` in inline mode (``--kv-transport inline``): the real KV.

    PreFillRequest ─checks─▶ POST /v1/completions {"prompt": ids, "max_tokens": 1,
        "kv_transfer_params": {"disagg_inline": {"action": "save", "key": K}}}
      (the engine's SidecarKVConnector writes <kv_staging_dir>/K/layer-*.kv, then meta.json)
      ─▶ KVBlock{layer -2: metadata} , KVBlock{layer l, block j, K tile, V tile} ... , done
      ─▶ <kv_staging_dir>/K removed (always: success, failure or cancellation)

The block layout and the metadata block are defined in ``sidecar.inline_kv.codec`` and
``protos/README.md``. Errors: no KV written by the engine (connector not configured, wrong
staging directory) -> FAILED_PRECONDITION; KV larger than ``max_staged_bytes`` ->
RESOURCE_EXHAUSTED (the sidecar never reads more than that into memory).

Deliberate limits: the engine's prefill finishes before the first block is sent (the
connector writes the layers as they are computed; the stream starts once the engine has
answered); the blocks of one request are held in memory while the stream is sent.
"""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from sidecar.core.legs import post_prefill
from sidecar.errors import ResourceExhausted, Stage
from sidecar.grpc_gen import disagg_pb2
from sidecar.grpc_server.bookkeeping import RpcScope
from sidecar.grpc_server.checks import check_temperature, check_token_ids, request_id_or_new
from sidecar.grpc_server.prefill import REQUEST_ID_HEADER, PrefillService
from sidecar.inline_kv.codec import meta_block, read_staged_meta, read_stream_messages

PARAMS_KEY = "disagg_inline"


class InlinePrefillService(PrefillService):
    """Prefill whose stream carries the engine's KV cache (see the module docstring)."""

    async def _handoff_messages(
        self, request: disagg_pb2.PreFillRequest, scope: RpcScope, time_remaining: float | None
    ) -> list[tuple[disagg_pb2.KVBlockStream, int]]:
        settings = self._runtime.settings
        token_ids = check_token_ids(request.token_ids)
        check_temperature(request.temperature)
        request_id = request_id_or_new(request.request_id)
        key = f"p-{uuid.uuid4().hex}"
        directory = Path(settings.kv_staging_dir) / key
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
        try:
            started = time.perf_counter()
            await post_prefill(
                self._runtime.session,
                self._url,
                body,
                {REQUEST_ID_HEADER: request_id},
                timeout_s=timeout_s,
                max_bytes=settings.max_prefill_response_bytes,
            )
            scope.observe("prefill", time.perf_counter() - started)
            meta = read_staged_meta(directory)
            nbytes = meta.layout.num_layers * meta.num_blocks * meta.layout.block_bytes
            if nbytes > settings.max_staged_bytes:
                raise ResourceExhausted(
                    f"the request's KV is {nbytes} bytes, over max_staged_bytes "
                    f"{settings.max_staged_bytes}",
                    stage=Stage.PREFILL,
                )
            head = meta_block(request_id, meta)
            # One thread hop for the whole read (the files are on tmpfs; bounded above).
            data = await asyncio.to_thread(read_stream_messages, request_id, meta, directory)
            tile_pair = 2 * meta.layout.tile_bytes
            return [(disagg_pb2.KVBlockStream(block=head), len(head.k_data))] + [
                (message, tile_pair) for message in data
            ]
        finally:
            # Synchronous on tmpfs: no cancellation can skip it.
            shutil.rmtree(directory, ignore_errors=True)
