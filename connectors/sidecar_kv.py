"""vLLM KV connector that hands a request's KV cache to / takes it from the local sidecar.

Load it with ``--kv-transfer-config '{"kv_connector": "SidecarKVConnector",
"kv_connector_module_path": "connectors.sidecar_kv", "kv_role": "kv_both",
"kv_connector_extra_config": {"staging_dir": "/dev/shm/disagg-kv"}}'`` (installed into the
engine's environment on its own: ``pip install ./connectors``, connectors/pyproject.toml). A
request opts in through its ``kv_transfer_params``:

- ``{"disagg_inline": {"action": "save", "key": K}}`` (prefill engine): in the step that
  completes the prompt, each attention layer's blocks of the request are written, layer by
  layer as ``save_kv_layer`` sees them, to ``<staging_dir>/K/layer-NNNN.kv``; ``meta.json``
  is written last (``wait_for_save``), so its presence means the KV is complete.
- ``{"disagg_inline": {"action": "load", "key": K}}`` (decode engine): the scheduler side
  reads ``<staging_dir>/K/meta.json``, checks the fingerprint against its own engine and
  reports ``min(staged tokens, prompt length - 1)`` external tokens; the worker side copies
  the staged blocks into the blocks vLLM allocated (``start_load_kv``), before the forward.

Why files on a shared tmpfs volume: the engine and its sidecar share a pod, and a memory
backed ``emptyDir`` (``/dev/shm``) gives a copy at memory bandwidth with no framing, no
extra server thread inside the engine and no back-pressure protocol; the sidecar reads the
files with plain ``read`` calls. A socket would copy the same bytes through the kernel twice
and need a protocol for partial failure; shared memory segments would need lifetime
management that the per-request directory (deleted by the sidecar) gives for free. The
notices are one non-blocking ``sendto`` per layer (microseconds); a lost one costs only
overlap, never correctness (see ``connectors.inline_layout``).

The byte layout is defined in ``connectors.inline_layout`` (K and V tiles
``[heads, block_size, head_size]`` per block). Only vLLM's CPU attention backend layout
(``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, K rows then V rows per head) is
supported: the connector refuses any other cache shape loudly instead of guessing.

Deliberate limits: one KV-cache group; no preemption handling for saves (a preempted request
is saved when its prompt completes again); loads are synchronous (no layer pipelining).
"""

from __future__ import annotations

import logging
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found, unused-ignore]
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from connectors.inline_layout import (
    ACTION_LOAD,
    ACTION_SAVE,
    ENGINE_FILE,
    INLINE_PARAMS_KEY,
    META_FILE,
    InlineLayout,
    InlineMeta,
    LayoutError,
    check_key,
    fingerprint,
    layer_file,
    notice_sender,
    send_notice,
    write_atomic,
)

logger = logging.getLogger(__name__)
DEFAULT_STAGING_DIR = "/dev/shm/disagg-kv"
_LAYER_RE = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_index(layer_name: str) -> int:
    """The decoder layer number in a vLLM layer name (``model.layers.3.self_attn.attn``)."""
    found = _LAYER_RE.findall(layer_name)
    if not found:
        raise ValueError(f"no layer index in {layer_name!r}")
    return int(found[-1])


def engine_layout(vllm_config: Any) -> InlineLayout:
    """This engine's KV layout and fingerprint, from its configuration alone."""
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    cc = vllm_config.cache_config
    dtype = mc.dtype if cc.cache_dtype == "auto" else cc.cache_dtype
    dtype_name = str(dtype).removeprefix("torch.")
    hf = mc.hf_config
    essentials = {
        "architectures": list(getattr(hf, "architectures", None) or []),
        "model_type": getattr(hf, "model_type", None),
        "hidden_size": getattr(hf, "hidden_size", None),
        "intermediate_size": getattr(hf, "intermediate_size", None),
        "vocab_size": getattr(hf, "vocab_size", None),
        "num_attention_heads": getattr(hf, "num_attention_heads", None),
        "rope_theta": getattr(hf, "rope_theta", None),
        "num_layers": mc.get_num_layers(pc),
        "num_kv_heads": mc.get_num_kv_heads(pc),
        "head_size": mc.get_head_size(),
        "dtype": dtype_name,
        "block_size": cc.block_size,
        "tensor_parallel_size": pc.tensor_parallel_size,
    }
    return InlineLayout(
        dtype=dtype_name,
        block_size=int(cc.block_size),
        num_kv_heads=int(mc.get_num_kv_heads(pc)),
        head_size=int(mc.get_head_size()),
        num_layers=int(mc.get_num_layers(pc)),
        fingerprint=fingerprint(essentials),
    )


@dataclass
class SaveOp:
    key: str
    block_ids: list[int]
    num_tokens: int


@dataclass
class LoadOp:
    key: str
    # (index of the staged block, vLLM block id to fill)
    pairs: list[tuple[int, int]]


@dataclass
class SidecarKVMetadata(KVConnectorMetadata):  # type: ignore[misc]
    saves: list[SaveOp] = field(default_factory=list)
    loads: list[LoadOp] = field(default_factory=list)


@dataclass
class _PendingSave:
    key: str
    prompt_len: int
    block_ids: list[int]


@dataclass
class _PendingLoad:
    key: str
    local_tokens: int
    matched_tokens: int


def _inline_params(request: Any) -> dict[str, Any] | None:
    params = getattr(request, "kv_transfer_params", None) or {}
    inline = params.get(INLINE_PARAMS_KEY) if isinstance(params, dict) else None
    return inline if isinstance(inline, dict) else None


class SidecarKVConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """KV connector of disagg-sidecar's inline mode (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._root = Path(str(extra.get("staging_dir", DEFAULT_STAGING_DIR)))
        self._root.mkdir(parents=True, exist_ok=True)
        self._layout = engine_layout(vllm_config)
        self._block_size = self._layout.block_size
        # Scheduler-side state.
        self._pending_saves: dict[str, _PendingSave] = {}
        self._pending_loads: dict[str, _PendingLoad] = {}
        self._loads_to_build: dict[str, _PendingLoad] = {}
        self._save_keys: dict[str, str] = {}
        # Worker side: the socket that sends layer notices, made on the first save.
        self._notices: socket.socket | None = None
        if role == KVConnectorRole.SCHEDULER:
            # The sidecar validates incoming KV against this document.
            write_atomic(self._root / ENGINE_FILE, _dumps(self._layout.to_dict()))
        logger.info("SidecarKVConnector %s: staging %s, layout %s", role, self._root, self._layout)

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        inline = _inline_params(request)
        if inline is not None and inline.get("action") == ACTION_SAVE:
            # NewRequestData lacks kv_transfer_params: remember the intent by request id.
            try:
                self._save_keys[request.request_id] = check_key(str(inline.get("key")))
            except LayoutError as exc:
                logger.warning("inline KV save for %s refused: %s", request.request_id, exc)
            return 0, False
        if inline is None or inline.get("action") != ACTION_LOAD:
            return 0, False
        try:
            key = check_key(str(inline.get("key")))
            meta = InlineMeta.from_json((self._root / key / META_FILE).read_bytes())
        except (OSError, LayoutError) as exc:
            logger.warning("inline KV for %s not usable: %s", request.request_id, exc)
            return 0, False
        if meta.layout != self._layout:
            logger.warning("inline KV for %s has a foreign layout; recomputing", request.request_id)
            return 0, False
        prompt_len = len(request.prompt_token_ids or [])
        # The last prompt token is always computed here: it yields the first new token.
        matched = min(meta.num_tokens, prompt_len - 1)
        if matched <= num_computed_tokens:
            return 0, False
        self._pending_loads[request.request_id] = _PendingLoad(key, num_computed_tokens, matched)
        return matched - num_computed_tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pending = self._pending_loads.pop(request.request_id, None)
        if pending is not None and num_external_tokens > 0:
            self._loads_to_build[request.request_id] = pending

    def build_connector_meta(self, scheduler_output: Any) -> SidecarKVMetadata:
        meta = SidecarKVMetadata()
        bs = self._block_size
        for new_req in scheduler_output.scheduled_new_reqs:
            block_ids = list(new_req.block_ids[0])
            load = self._loads_to_build.pop(new_req.req_id, None)
            if load is not None:
                first = load.local_tokens // bs  # local prefix hits are whole blocks
                last = -(-load.matched_tokens // bs)
                meta.loads.append(LoadOp(load.key, [(j, block_ids[j]) for j in range(first, last)]))
                continue
            key = self._save_keys.pop(new_req.req_id, None)
            if key is not None:
                prompt_len = len(new_req.prompt_token_ids or [])
                self._pending_saves[new_req.req_id] = _PendingSave(key, prompt_len, block_ids)
                computed = new_req.num_computed_tokens
                self._maybe_emit_save(meta, new_req.req_id, computed, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            pending = self._pending_saves.get(req_id)
            if pending is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    pending.block_ids = list(new_ids[0])
                else:
                    pending.block_ids.extend(new_ids[0])
            self._maybe_emit_save(meta, req_id, cached.num_computed_tokens[i], scheduler_output)
        return meta

    def _maybe_emit_save(
        self, meta: SidecarKVMetadata, req_id: str, computed: int, out: Any
    ) -> None:
        pending = self._pending_saves[req_id]
        scheduled = int(out.num_scheduled_tokens.get(req_id, 0))
        if computed + scheduled < pending.prompt_len:
            return  # chunked prefill: save in the step that completes the prompt
        nblocks = -(-pending.prompt_len // self._block_size)
        meta.saves.append(SaveOp(pending.key, pending.block_ids[:nblocks], pending.prompt_len))
        del self._pending_saves[req_id]

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._pending_saves.pop(request.request_id, None)
        self._save_keys.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        self._loads_to_build.pop(request.request_id, None)
        # Saves are written synchronously in the forward pass: the blocks can be freed now.
        return False, None

    # ------------------------------------------------------------------ worker side

    def _check_cache(self, kv: Any) -> tuple[int, int, int, int]:
        lay = self._layout
        shape = tuple(kv.shape)
        want = (lay.num_kv_heads, lay.block_size, 2 * lay.head_size)
        if kv.dim() != 4 or shape[1:] != want or not kv.is_contiguous():
            raise RuntimeError(
                "SidecarKVConnector supports the CPU backend layout "
                f"[blocks, {want}] only; got {shape}"
            )
        return shape[0], lay.num_kv_heads, lay.block_size, lay.head_size

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, SidecarKVMetadata) or not meta.loads:
            return
        dtype = getattr(torch, self._layout.dtype)
        tile = self._layout.tile_bytes
        for layer_name, layer in forward_context.no_compile_layers.items():
            kv = getattr(layer, "kv_cache", None)
            if not isinstance(kv, torch.Tensor):
                continue
            nb, h, n, c = self._check_cache(kv)
            # Per (block, head): block_size K rows, then block_size V rows (see cpu_attn).
            view = kv.view(nb, h, 2 * n, c)
            idx = layer_index(layer_name)
            for op in meta.loads:
                data = (self._root / op.key / layer_file(idx)).read_bytes()
                for j, block_id in op.pairs:
                    base = j * 2 * tile
                    rec = torch.frombuffer(bytearray(data[base : base + 2 * tile]), dtype=dtype)
                    kv_pair = rec.view(2, h, n, c)
                    view[block_id, :, :n, :] = kv_pair[0]
                    view[block_id, :, n:, :] = kv_pair[1]

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, SidecarKVMetadata) or not meta.saves:
            return
        nb, h, n, c = self._check_cache(kv_layer)
        view = kv_layer.view(nb, h, 2 * n, c)
        idx = layer_index(layer_name)
        for op in meta.saves:
            blocks = view[torch.tensor(op.block_ids, dtype=torch.long)]  # [b, h, 2n, c]
            # -> [b, 2 (K, V), h, n, c]: each block's K tile then its V tile.
            records = torch.stack((blocks[:, :, :n, :], blocks[:, :, n:, :]), dim=1).contiguous()
            out_dir = self._root / op.key
            out_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(out_dir / layer_file(idx), records.cpu().numpy().tobytes())
            if self._notices is None:
                self._notices = notice_sender()
            send_notice(self._notices, self._root, op.key, idx)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, SidecarKVMetadata):
            return
        for op in meta.saves:
            doc = InlineMeta(self._layout, op.num_tokens, len(op.block_ids), op.key)
            write_atomic(self._root / op.key / META_FILE, doc.to_json())


def _dumps(doc: dict[str, Any]) -> bytes:
    import json

    return json.dumps(doc, sort_keys=True).encode()
