"""Engine handlers by wire name (the pod label ``model.aibrix.ai/engine``).

Resolution follows the seed: an unknown engine name resolves to the ``default`` handler
(synchronous prefill, no augmentation), so a new engine still gets a plain P-then-D flow.
"""

from __future__ import annotations

from sidecar.engines.base import EngineHandler
from sidecar.registry import LazyRegistry

DEFAULT_ENGINE = "default"

ENGINES: LazyRegistry[EngineHandler] = LazyRegistry("engine", EngineHandler)
ENGINES.register("default", "sidecar.engines.default:DefaultHandler")
ENGINES.register("sglang", "sidecar.engines.sglang:SGLangHandler")
ENGINES.register("trtllm", "sidecar.engines.trtllm:TRTLLMHandler")
ENGINES.register("vllm", "sidecar.engines.vllm:VLLMHandler")


def resolve_engine(name: str) -> EngineHandler:
    """The handler for ``name``; the default handler for names not registered."""
    return ENGINES.get(name if name in ENGINES else DEFAULT_ENGINE)


def valid_engine_names() -> list[str]:
    """Registered engine names, sorted."""
    return ENGINES.names()


__all__ = ["DEFAULT_ENGINE", "ENGINES", "EngineHandler", "resolve_engine", "valid_engine_names"]
