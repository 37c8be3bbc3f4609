"""What every vLLM dialect shares: the engine, its tokenizer, the ``kv_transfer_params`` key.

vLLM's hand-off lives in ``kv_transfer_params``, whose shape depends on the KV connector the
pods run; one dialect per connector (chosen by the connector pod label) subclasses this:

    vllm_nixl.py      NixlConnector, pull (label ``shfs``): prefill first, decode reads the blocks
    vllm_neuron.py    NIXL on AWS Neuron (label ``nixl``): the whole prefill answer rides along
    vllm_mooncake.py  MooncakeConnector, push (label ``mooncake``): both legs at once
    vllm_inline.py    this project's own connector (``--kv-transport inline``, gRPC only)
"""

from __future__ import annotations

from typing import Final

from sidecar.dialects.base import Dialect, TokenizeEndpoint

KV_TRANSFER_PARAMS: Final = "kv_transfer_params"


class VLLMDialect(Dialect):
    """The vLLM engine; a connector dialect says what its ``kv_transfer_params`` hold."""

    engine = "vllm"
    handoff_keys = frozenset({KV_TRANSFER_PARAMS})
    #: ``/tokenize`` takes a completions ``prompt`` or chat ``messages`` (rendered by these).
    tokenize = TokenizeEndpoint("/tokenize", chat=True, chat_fields=(
        "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
        "chat_template_kwargs", "tools", "mm_processor_kwargs",
    ))
