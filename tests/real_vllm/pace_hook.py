"""Test-only start-up hook for the ENGINE venv (``engine_site.py`` loads it): a floor under
each engine step's time.

Does nothing unless ``DISAGG_ENGINE_STEP_S`` is set. Then each step of vLLM's engine core
that ran the model is followed by that many seconds of sleep before its outputs leave for
the API server.

Why: a test that kills an engine in the middle of an answer needs the answer still decoding
when the kill lands. The test model writes 360 tokens in about a second, and the kill is
sent by a client that reads the stream through a sidecar, which on a loaded 2-core machine
was seen to see its first chunk 0.76 s after sending, when the engine had written the whole
answer (tests/real_vllm/test_migration.py failed three rounds of three that way in CI,
2026-12-06). A pace the engine cannot beat makes the kill land mid-answer whatever the
client's lag, up to the answer's length times the floor. What the engine computes, and the
order it writes it in, are vLLM's own; only the time between steps grows.

How: ``EngineCore.step`` of ``vllm.v1.engine.core`` is wrapped right after the module
loads, before any engine core exists (the core binds ``self.step`` when it starts). In the
API server the module loads as well, and nothing there calls ``step``.
"""

from __future__ import annotations

import os
import time
from types import ModuleType
from typing import Any

ENV_VAR = "DISAGG_ENGINE_STEP_S"


def patches() -> dict[str, Any]:
    """``engine_site``'s patches: the engine core's module, where the floor is set."""
    floor = os.environ.get(ENV_VAR, "")
    if not floor:
        return {}
    return {"vllm.v1.engine.core": lambda module: _pace(module, float(floor))}


def _pace(module: ModuleType, floor_s: float) -> None:
    core = module.EngineCore
    original = core.step

    def step(self: Any) -> tuple[Any, bool]:
        outputs, model_executed = original(self)
        if model_executed:
            time.sleep(floor_s)
        return outputs, model_executed

    core.step = step
