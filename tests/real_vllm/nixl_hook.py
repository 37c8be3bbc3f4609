"""Test-only start-up hook for the ENGINE venv: gives NIXL's progress thread a poll delay.

Installed by setup_env.sh as ``disagg_nixl_hook`` plus a ``.pth`` line that imports it at
every interpreter start of the engine venv (never the sidecar's venv).

Why: NIXL's Python wrapper (``nixl_agent``) builds its agent config with ``pthrDelay = 0``,
so the UCX progress thread of every idle NIXL instance spins a whole core. On a 2-core test
machine two idle vLLM engines with NixlConnector saturate both cores and slow everything
several times over. The wrapper does not expose the knob, so this hook wraps the binding's
``nixlAgent`` constructor and sets ``pthrDelay`` on the config just before the agent is made.

How: when ``DISAGG_NIXL_PTHR_DELAY_US`` is set (the test harness sets it), a meta-path finder
waits for the NIXL binding module to be imported (lazily: nothing is imported at start-up)
and patches it right after it loads.

Deliberate limits: does nothing at all without the variable; knows the binding module names
of the nixl 1.5 wheels (``nixl_cu12/13``, ``nixl_rocm``); transfers still work, idle CPU is 0,
and each progress poll may wait up to the delay (tests do not measure NIXL latency).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

ENV_VAR = "DISAGG_NIXL_PTHR_DELAY_US"
_BINDING_MODULES = frozenset({"nixl_cu12._bindings", "nixl_cu13._bindings", "nixl_rocm._bindings"})


def _patch(module: ModuleType, delay_us: int) -> None:
    original: Callable[..., Any] = getattr(module, "nixlAgent")  # noqa: B009 - a binding

    def nixl_agent_with_delay(name: str, config: Any, *rest: Any) -> Any:
        config.pthrDelay = delay_us
        return original(name, config, *rest)

    setattr(module, "nixlAgent", nixl_agent_with_delay)  # noqa: B010 - a binding
    print(f"disagg_nixl_hook: NIXL pthrDelay={delay_us}us", file=sys.stderr, flush=True)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, delay_us: int) -> None:
        self._inner = inner
        self._delay_us = delay_us

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _patch(module, self._delay_us)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, delay_us: int) -> None:
        self._delay_us = delay_us

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _BINDING_MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, self._delay_us)
                return spec
        return None


def install() -> None:
    raw = os.environ.get(ENV_VAR, "")
    if not raw:
        return
    try:
        delay_us = int(raw)
    except ValueError:
        print(f"disagg_nixl_hook: ignoring non-integer {ENV_VAR}={raw!r}", file=sys.stderr)
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(delay_us))


install()
