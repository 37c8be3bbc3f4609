"""What every vLLM dialect shares: the engine, its tokenizer, the ``kv_transfer_params`` key.

vLLM's hand-off lives in ``kv_transfer_params``, whose shape depends on the KV connector the
pods run; one dialect per connector (chosen by the connector pod label) subclasses this:

    vllm_nixl.py      NixlConnector, pull (label ``shfs``): prefill first, decode reads the blocks
    vllm_neuron.py    NIXL on AWS Neuron (label ``nixl``): the whole prefill answer rides along
    vllm_mooncake.py  MooncakeConnector, push (label ``mooncake``): both legs at once
    vllm_nixl_push.py NixlPushConnector (label ``nixl-push``): both legs at once once the
                      prefill target's identity is learned
    vllm_inline.py    this project's own connector (``--kv-transport inline``, gRPC only)

The KV layout (``kv_layout``): vLLM states its cache's configuration on ``/metrics`` as the
labels of ``vllm:cache_config_info`` (``vllm/v1/metrics/loggers.py``, ``log_metrics_info``;
every field of ``CacheConfig``). Of those, two engines must share the KV cache's dtype
(``cache_dtype``: a factor of NIXL's compatibility hash, ``compute_nixl_compatibility_hash``
in ``nixl/metadata.py``, and what any connector's bytes mean); block sizes and tensor-parallel
sizes may differ (NIXL's handshake maps them: ``_validate_remote_agent_handshake``, its
``block_size_ratio`` and ``tp_ratio``).

Migration (``sidecar.request.migration``): with ``return_token_ids`` vLLM's completions and
chat streams carry each chunk's ``token_ids`` and the prompt's in the first chunk (on the
choice; at the chunk's top for chat; both ``null`` when not asked: the fixtures under
``tests/fixtures/vllm``); ``/inference/v1/generate`` always carries them. A prefill engine
(``kv_producer``) runs a request without hand-off fields whole, so it can take a moved one;
``/detokenize`` reads ids back as text. The Responses and Messages streams carry no ids.

Data parallelism: vLLM's API server places a request on the rank its ``X-data-parallel-rank``
header names (one API server for all ranks, internal load balancing); every vLLM dialect
sends it on both legs when the engine has several ranks, and nothing otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from sidecar.dialects.base import Dialect, IdsText, KVLayoutSource, TokenizeEndpoint
from sidecar.dialects.continuation import (
    VLLM_CHAT,
    VLLM_GENERATE,
    completions_places,
    continuation_body,
    refusal,
)
from sidecar.errors import InvalidHandoff
from sidecar.protocol.context import Route
from sidecar.protocol.continuation import TokenIdPlaces

KV_TRANSFER_PARAMS: Final = "kv_transfer_params"
#: The header vLLM's API server reads a request's data-parallel rank from.
DATA_PARALLEL_RANK_HEADER: Final = "X-data-parallel-rank"

#: Where vLLM's streams carry token ids, by route.
TOKEN_ID_PLACES: Final[Mapping[Route, TokenIdPlaces]] = {
    Route.COMPLETIONS: completions_places(unasked_null=True),
    Route.CHAT: VLLM_CHAT,
    Route.GENERATE: VLLM_GENERATE,
}


#: The metric whose labels are the engine's ``CacheConfig``.
CACHE_CONFIG_INFO: Final = b"vllm:cache_config_info{"
#: The cache's facts two engines must share to hand KV over.
SHARED_CACHE_FACTS: Final = ("cache_dtype",)
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def cache_config(metrics: bytes) -> Mapping[str, str] | None:
    """The shared facts of the KV cache, from a ``/metrics`` page (its first
    ``vllm:cache_config_info`` sample); None when it has none."""
    start = metrics.find(b"\n" + CACHE_CONFIG_INFO) + 1
    if not start and not metrics.startswith(CACHE_CONFIG_INFO):
        return None
    end = metrics.find(b"\n", start)
    line = metrics[start: end if end >= 0 else len(metrics)].decode("utf-8", "replace")
    labels = dict(_LABEL.findall(line))
    facts = {fact: labels[fact] for fact in SHARED_CACHE_FACTS if fact in labels}
    return facts or None


class VLLMDialect(Dialect):
    """The vLLM engine; a connector dialect says what its ``kv_transfer_params`` hold."""

    engine = "vllm"
    ranked = True
    rank_header = DATA_PARALLEL_RANK_HEADER
    handoff_keys = frozenset({KV_TRANSFER_PARAMS})
    #: ``/tokenize`` takes a completions ``prompt`` (with ``add_special_tokens``) or chat
    #: ``messages`` (rendered by these); a ``cache_salt`` keys a request's blocks apart, and
    #: ``truncate_prompt_tokens`` keeps only the prompt's last ids, which ``/tokenize`` does
    #: not apply (vLLM 0.32 ``serve/tokenize/protocol.py``, ``openai/*/protocol.py``).
    tokenize = TokenizeEndpoint(
        "/tokenize", chat=True,
        chat_fields=("add_generation_prompt", "continue_final_message", "add_special_tokens",
                     "chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs"),
        prompt_fields=("add_special_tokens",),
        unkeyed_fields=("cache_salt", "truncate_prompt_tokens"),
    )
    kv_layout = KVLayoutSource("/metrics", cache_config)
    prefill_decodes = True
    ids_text = IdsText("/detokenize", ids_field="tokens", text_field="prompt")

    def token_ids(self, route: Route) -> TokenIdPlaces | None:
        return TOKEN_ID_PLACES.get(route)

    def continuation_refusal(self, route: Route, body: Mapping[str, Any]) -> str | None:
        return refusal(route, body)

    def continuation(self, route: Route, body: Mapping[str, Any], prompt_ids: list[int],
                     ids: list[int]) -> tuple[Route, dict[str, Any]]:
        return continuation_body(route, body, prompt_ids, ids,
                                              TOKEN_ID_PLACES[route])

    @classmethod
    def no_handoff(cls, what: str) -> InvalidHandoff:
        """A prefill answer without this connector's hand-off: names the connector the
        sidecar expected and how to check the one the engines run (a connector mismatch is
        the usual cause)."""
        runs = cls.aliases[0] if cls.aliases else f"the {cls.connector!r} connector"
        return InvalidHandoff(
            f"{what}: this sidecar expects vLLM's {runs} (kv connector {cls.connector!r}, "
            "from --kv-connector, DISAGG_KV_CONNECTOR or the connector pod label); check the "
            "connector in the engines' "
            "--kv-transfer-config (vLLM logs the one it loads at start) and set this "
            "sidecar's to match (vLLM also leaves the hand-off out of a prefill that did not "
            "end at its one-token limit)"
        )
