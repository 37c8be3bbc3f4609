"""NIXL on AWS Neuron (pod label ``nixl``): the whole prefill response rides to decode.

docs/driving/handoffs.md#neuron-nixl: the prefill body gets nothing; the decode body gets
``"disagg_prefill_resp": <the entire prefill response JSON>``, always, with no top-level
``kv_transfer_params`` and no ``remote_host`` rewrite: Neuron's connector finds what it needs
inside that object.

Routes: completions and chat only (the connector reads a completions answer); every other
route runs whole on the local engine.

Deliberate limits: the response is passed as received (not copied, never modified); its
content is not validated here because the Neuron connector owns its meaning.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sidecar.dialects.vllm import VLLMDialect
from sidecar.errors import InvalidHandoff
from sidecar.protocol.context import HandoffContext

DISAGG_PREFILL_RESP = "disagg_prefill_resp"


class NeuronNixlDialect(VLLMDialect):
    """Sequential legs; decode gets the prefill response wrapped whole."""

    connector = "nixl"
    handoff_keys = frozenset({DISAGG_PREFILL_RESP})
    checked_against = "AIBrix NIXLAgent (Neuron vLLM): disagg_prefill_resp wrapping"

    def handoff(
        self, prefill_response: Mapping[str, Any] | None, ctx: HandoffContext
    ) -> dict[str, Any]:
        if prefill_response is None:
            raise InvalidHandoff("Neuron NIXL hand-off needs the prefill response")
        return {DISAGG_PREFILL_RESP: prefill_response}
