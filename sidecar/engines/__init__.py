"""Engine handlers by wire name (the pod label ``model.aibrix.ai/engine``).

Resolution follows the seed: an unknown engine name resolves to the ``default`` handler
(synchronous prefill, no augmentation), so a new engine still gets a plain P-then-D flow.
``build_handler`` binds the KV agent an engine uses (vLLM) once, when the runtime is built;
``handoff_keys`` is what every handler and agent declares it owns (the client-body refusal
list and the demo derive theirs from it).
"""

from __future__ import annotations

from sidecar.engines.base import EngineHandler
from sidecar.kv_agents import AGENTS, KVTransferAgent, resolve_agent
from sidecar.kv_agents.inline import InlineAgent
from sidecar.registry import LazyRegistry

DEFAULT_ENGINE = "default"

ENGINES: LazyRegistry[EngineHandler] = LazyRegistry("engine", EngineHandler)
ENGINES.register("default", "sidecar.engines.default:DefaultHandler")
ENGINES.register("sglang", "sidecar.engines.sglang:SGLangHandler")
ENGINES.register("trtllm", "sidecar.engines.trtllm:TRTLLMHandler")
ENGINES.register("vllm", "sidecar.engines.vllm:VLLMHandler")


def resolve_engine(name: str) -> EngineHandler:
    """The handler for ``name`` (no agent bound); the default handler for unknown names."""
    return ENGINES.get(name if name in ENGINES else DEFAULT_ENGINE)


def build_handler(engine: str, kv_connector: str) -> EngineHandler:
    """The handler for ``engine`` with the agent of ``kv_connector`` bound where it uses one."""
    handler = resolve_engine(engine)
    agent: KVTransferAgent | None = (
        resolve_agent(kv_connector) if handler.uses_kv_agent else None
    )
    return handler.bind(agent)


def valid_engine_names() -> list[str]:
    """Registered engine names, sorted."""
    return ENGINES.names()


def handoff_keys() -> tuple[str, ...]:
    """Every top-level body key some handler or agent owns in a hand-off, sorted."""
    keys: set[str] = {*InlineAgent.handoff_keys}
    for name in ENGINES:
        keys |= ENGINES.get(name).handoff_keys
    for name in AGENTS:
        keys |= AGENTS.get(name).handoff_keys
    return tuple(sorted(keys))


__all__ = [
    "DEFAULT_ENGINE",
    "ENGINES",
    "EngineHandler",
    "build_handler",
    "handoff_keys",
    "resolve_engine",
    "valid_engine_names",
]
