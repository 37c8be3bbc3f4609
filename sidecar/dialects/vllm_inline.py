"""The inline KV transport's dialect (``--kv-transport inline``): KV bytes ride the gRPC stream.

This project's own vLLM connector (``connectors.sidecar_kv``) reads one key inside
``kv_transfer_params`` (defined next to the connector's layout, ``connectors.inline_layout``):

    prefill kv_transfer_params = {"disagg_inline": {"action": "save", "key": K}}
    decode kv_transfer_params  = {"disagg_inline": {"action": "load", "key": K}}

``K`` names the request's directory in the staging area shared with the engine (the
transport chooses it, ``sidecar.grpc_server.inline``, and hands it in with ``keyed``: the prefill
and the
decode side each choose one for their own engine, so the two keys of one request differ).
The KV itself never appears in a body. The prefill body is the prompt and the model only:
one token at temperature 0, since the KV of the prompt is all that is wanted.

Deliberate limits: not in the label registry (``DIALECTS``): the inline transport is chosen by
``--kv-transport``, only for the gRPC front door, and never mixes with a connector label.
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
            # One token: the KV of the prompt is what is wanted; decode generates the rest.
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
