"""The inline KV transport's agent (``--kv-transport inline``): KV bytes ride the gRPC stream.

This project's own vLLM connector (``connectors.sidecar_kv``) reads one key inside
``kv_transfer_params`` (defined next to the connector's layout, ``connectors.inline_layout``):

    prefill kv_transfer_params = {"disagg_inline": {"action": "save", "key": K}}
    decode kv_transfer_params  = {"disagg_inline": {"action": "load", "key": K}}

``K`` names the request's directory in the staging area shared with the engine
(``ctx.inline_key``, chosen by the prefill or decode side for its own engine: the two keys of
one request differ). The KV itself never appears in a body.

Deliberate limits: not in the label registry (``AGENTS``): the inline transport is chosen by
``--kv-transport``, only for the gRPC front door, and never mixes with a connector label.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from connectors.inline_layout import ACTION_LOAD, ACTION_SAVE, INLINE_PARAMS_KEY
from sidecar.errors import SidecarError
from sidecar.kv_agents.base import KVTransferAgent
from sidecar.protocol.context import HandoffContext

KV_TRANSFER_PARAMS = "kv_transfer_params"


class InlineAgent(KVTransferAgent):
    """Sequential legs; both bodies name the request's staging key."""

    name = "inline"
    handoff_keys = frozenset({KV_TRANSFER_PARAMS})
    checked_against = "this project's SidecarKVConnector (connectors.sidecar_kv)"

    def prefill_fields(self, ctx: HandoffContext) -> dict[str, Any]:
        return save_fields(_key(ctx))

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
    if ctx.inline_key is None:
        raise SidecarError("inline KV request has no staging key")
    return ctx.inline_key
