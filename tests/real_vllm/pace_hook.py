"""Test-only start-up hook for the ENGINE venv: a floor under each engine step's time.

Loaded by a ``sitecustomize`` that ``install_dir`` writes into a directory the engine's
``PYTHONPATH`` names (``EngineSpec.extra_env``); does nothing unless ``DISAGG_ENGINE_STEP_S``
is set. Then each step of vLLM's engine core that ran the model is followed by that many
seconds of sleep before its outputs leave for the API server.

Why: a test that kills an engine in the middle of an answer needs the answer still decoding
when the kill lands. The test model writes 360 tokens in about a second, and the kill is
sent by a client that reads the stream through a sidecar, which on a loaded 2-core machine
was seen to see its first chunk 0.76 s after sending, when the engine had written the whole
answer (tests/real_vllm/test_migration.py failed three rounds of three that way in CI,
2026-12-06). A pace the engine cannot beat makes the kill land mid-answer whatever the
client's lag, up to the answer's length times the floor. What the engine computes, and the
order it writes it in, are vLLM's own; only the time between steps grows.

How: a meta-path finder wraps ``EngineCore.step`` of ``vllm.v1.engine.core`` right after the
module loads, before any engine core exists (the core binds ``self.step`` when it starts).
The engine core is a child process of the API server: it inherits the environment and loads
the hook too; in the API server the module loads as well, and nothing there calls ``step``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

ENV_VAR = "DISAGG_ENGINE_STEP_S"
_ENGINE_CORE = "vllm.v1.engine.core"
# Loaded by its path: the suite's directory never goes on the engine's sys.path.
_SITECUSTOMIZE = """\
import importlib.util
_spec = importlib.util.spec_from_file_location("disagg_pace_hook", {hook!r})
_spec.loader.exec_module(importlib.util.module_from_spec(_spec))
"""


def _pace(module: ModuleType, floor_s: float) -> None:
    core = module.EngineCore
    original = core.step

    def step(self: Any) -> tuple[Any, bool]:
        outputs, model_executed = original(self)
        if model_executed:
            time.sleep(floor_s)
        return outputs, model_executed

    core.step = step


class _PacingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, floor_s: float) -> None:
        self._inner = inner
        self._floor_s = floor_s

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _pace(module, self._floor_s)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, floor_s: float) -> None:
        self._floor_s = floor_s

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _ENGINE_CORE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PacingLoader(spec.loader, self._floor_s)
                return spec
        return None


def install_dir(directory: Path) -> Path:
    """Write a ``sitecustomize`` that loads this hook into ``directory`` (put it on the
    engine's ``PYTHONPATH``, with ``DISAGG_ENGINE_STEP_S`` set); the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    hook = str(Path(__file__).resolve())
    (directory / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(hook=hook))
    return directory


def _install() -> None:
    floor = os.environ.get(ENV_VAR, "")
    if floor and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(float(floor)))


_install()
