"""Dialects by the pod labels that name them: the engine, and for vLLM the KV connector.

One line per dialect (``DIALECTS.register``); installed packages add theirs through the
``disagg_sidecar.dialects`` entry points (``sidecar.dialects.registry``). Resolution
(docs/driving/handoffs.md#resolution): no engine label -> ``DEFAULT_ENGINE``; an engine nobody
registered -> the "default" dialect (a name the configuration lets in only with
``--allow-unregistered-engine``: ``sidecar.config.checks``); an engine with connectors (vLLM)
-> its connector label's dialect (a missing or unknown label: the configured default, in the
loader); ``--kv-transport inline`` -> ``InlineDialect``, for the gRPC door only.
``handoff_keys()`` is every body key some dialect owns: the client-body refusal list and the
demo derive from it.
"""

from __future__ import annotations

from typing import Final

from sidecar.dialects.base import Dialect, DialectSetup, Legs
from sidecar.dialects.registry import DialectLoadError, DialectRegistry, UnknownName
from sidecar.dialects.vllm_inline import InlineDialect

#: The engine a pod without an engine label runs.
DEFAULT_ENGINE: Final = "vllm"
#: The dialect of an engine nobody registered.
FALLBACK_ENGINE: Final = "default"
#: The connector a connector-using engine gets when nothing names one.
DEFAULT_CONNECTOR: Final = "shfs"

DIALECTS = DialectRegistry()
DIALECTS.register("default", "sidecar.dialects.default:DefaultDialect")
DIALECTS.register("sglang", "sidecar.dialects.sglang:SGLangDialect")
DIALECTS.register("trtllm", "sidecar.dialects.trtllm:TRTLLMDialect")
DIALECTS.register("vllm.mooncake", "sidecar.dialects.vllm_mooncake:MooncakeDialect")
DIALECTS.register("vllm.nixl", "sidecar.dialects.vllm_neuron:NeuronNixlDialect")
DIALECTS.register("vllm.nixl-push", "sidecar.dialects.vllm_nixl_push:NixlPushDialect")
DIALECTS.register("vllm.shfs", "sidecar.dialects.vllm_nixl:NixlPullDialect")


def uses_connectors(engine: str) -> bool:
    """True when ``engine``'s dialects are chosen by a KV connector label (vLLM)."""
    return bool(DIALECTS.connectors(engine))


def dialect_class(engine: str, connector: str | None) -> type[Dialect]:
    """The dialect of ``engine`` (with ``connector`` where the engine has connectors)."""
    if uses_connectors(engine):
        return DIALECTS.get(engine, connector or DEFAULT_CONNECTOR)
    return DIALECTS.get(engine if DIALECTS.has(engine) else FALLBACK_ENGINE)


def handoff_keys() -> tuple[str, ...]:
    """Every top-level body key some dialect owns in a hand-off, sorted."""
    keys: set[str] = set(InlineDialect.handoff_keys)
    for engine, connector in DIALECTS:
        keys |= DIALECTS.get(engine, connector).handoff_keys
    return tuple(sorted(keys))


__all__ = [
    "DEFAULT_CONNECTOR",
    "DEFAULT_ENGINE",
    "DIALECTS",
    "FALLBACK_ENGINE",
    "Dialect",
    "DialectLoadError",
    "DialectSetup",
    "InlineDialect",
    "Legs",
    "UnknownName",
    "dialect_class",
    "handoff_keys",
    "uses_connectors",
]
