"""The inline KV transport's dialect (``--kv-transport inline``): KV bytes ride the gRPC stream.

This project's vLLM connector (``connectors.sidecar_kv``) reads one key inside
``kv_transfer_params`` (``connectors.inline_layout``; docs/driving/handoffs.md#inline):

    prefill kv_transfer_params = {"disagg_inline": {"action": "save", "key": K}}
    decode kv_transfer_params  = {"disagg_inline": {"action": "load", "key": K}}

``K`` names the request's directory in the staging area shared with the engine, chosen by
each side's transport for its own engine (``sidecar.grpc_server.inline``, handed in with
``keyed``): the two keys of one request differ, and the KV never appears in a body. The
prefill body is the prompt and the model, one token at temperature 0 (the prompt's KV is all
that is wanted). Deliberate limits: not in the label registry (``DIALECTS``): chosen by
``--kv-transport``, for the gRPC front door only, never mixed with a connector label.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from connectors.inline_layout import ACTION_LOAD, ACTION_SAVE, INLINE_PARAMS_KEY
from sidecar.dialects.vllm import KV_TRANSFER_PARAMS, VLLMDialect
from sidecar.errors import SidecarError
from sidecar.protocol.context import HandoffContext


class InlineDialect(VLLMDialect):
    """Sequential legs; both bodies name the request's staging key."""

    connector = "inline"
    checked_against = "this project's SidecarKVConnector (connectors.sidecar_kv)"

    def keyed(self, ctx: HandoffContext, key: str) -> HandoffContext:
        """``ctx`` naming the staging key ``key`` (chosen by the transport)."""
        return ctx.with_state(key)

    def prefill_body(self, client_body: Mapping[str, Any], ctx: HandoffContext) -> dict[str, Any]:
        return {
            "model": client_body["model"],
            "prompt": client_body["prompt"],
            "max_tokens": 1,
            "temperature": 0.0,
            **save_fields(_key(ctx)),
        }

    def handoff(
        self, prefill_response: Mapping[str, Any] | None, ctx: HandoffContext
    ) -> dict[str, Any]:
        return load_fields(_key(ctx))


def save_fields(key: str) -> dict[str, Any]:
    """The prefill body's fields: the engine saves the request's KV under ``key``."""
    return {KV_TRANSFER_PARAMS: {INLINE_PARAMS_KEY: {"action": ACTION_SAVE, "key": key}}}


def load_fields(key: str) -> dict[str, Any]:
    """The decode body's fields: the engine loads the KV staged under ``key``."""
    return {KV_TRANSFER_PARAMS: {INLINE_PARAMS_KEY: {"action": ACTION_LOAD, "key": key}}}


def _key(ctx: HandoffContext) -> str:
    if not isinstance(ctx.state, str):
        raise SidecarError("inline KV request has no staging key")
    return ctx.state
