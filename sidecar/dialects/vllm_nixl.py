"""vLLM NixlConnector, pull flow (pod label ``shfs``): prefill first, decode reads the blocks.

docs/driving/handoffs.md#vllm-nixl-pull:

    prefill kv_transfer_params = {do_remote_decode: true, do_remote_prefill: false,
                                  remote_engine_id: null, remote_block_ids: null,
                                  remote_host: null, remote_port: null}
    decode kv_transfer_params  = the prefill response's kv_transfer_params, verbatim and in
                                 order (keys of future versions too), except
                                 remote_host := ctx.advertise_host (vLLM's default from
                                 VLLM_NIXL_SIDE_CHANNEL_HOST, localhost, is wrong across pods)

Routes (vLLM 0.32, ``tests/fixtures/vllm/0.32.0/routes``): completions, chat, Responses,
Messages and ``/inference/v1/generate`` (with ``--enable-scale-out``) all take
``kv_transfer_params`` at the top level of the request and answer it at the top level of
the prefill's JSON, so every route is a pair with the same hand-off.

Deliberate limits: a response without usable params is an ``InvalidHandoff``, never a decode
without them (vLLM would silently recompute the prompt), so builds from before
``remote_request_id`` existed are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sidecar import jsonutil
from sidecar.dialects.vllm import KV_TRANSFER_PARAMS, VLLMDialect
from sidecar.errors import InvalidHandoff
from sidecar.protocol.context import HandoffContext, Route

REMOTE_HOST = "remote_host"

#: Keys the decode engine needs; without any of them vLLM recomputes the prompt locally.
REQUIRED_DECODE_KEYS: tuple[str, ...] = (
    "do_remote_prefill",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    REMOTE_HOST,
    "remote_port",
)


class NixlPullDialect(VLLMDialect):
    """Sequential NIXL hand-off: a skeleton on prefill, the engine's params on decode."""

    connector = "shfs"
    #: vLLM's ``kv_connector`` class for this flow (AIBrix's label value is ``shfs``).
    aliases = ("NixlConnector",)
    pd_routes = frozenset(Route)
    checked_against = (
        "vLLM main (2026 snapshot) NixlConnector.request_finished "
        "(remote_request_id, tp_size, remote_num_tokens, ...)"
    )

    def prefill_fields(self, ctx: HandoffContext) -> dict[str, Any]:
        return {
            KV_TRANSFER_PARAMS: {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            }
        }

    def handoff(
        self, prefill_response: Mapping[str, Any] | None, ctx: HandoffContext
    ) -> dict[str, Any]:
        if prefill_response is None:
            raise InvalidHandoff("NIXL hand-off needs the prefill response")
        params = prefill_response.get(KV_TRANSFER_PARAMS)
        if params is None:
            # Another connector's engines, or a prefill that did not end at the length cap.
            raise self.no_handoff("prefill response has no kv_transfer_params")
        if not isinstance(params, Mapping):
            raise InvalidHandoff(
                f"prefill response kv_transfer_params is a {jsonutil.type_name(params)}, "
                "expected an object"
            )
        missing = [key for key in REQUIRED_DECODE_KEYS if key not in params]
        if missing:
            raise InvalidHandoff(
                "prefill response kv_transfer_params lacks " + ", ".join(missing)
            )
        decode_params = dict(params)
        decode_params[REMOTE_HOST] = ctx.advertise_host
        return {KV_TRANSFER_PARAMS: decode_params}
