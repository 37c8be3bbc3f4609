"""Test-only start-up hook for the ENGINE venv: fits NIXL engines to a small CPU test machine.

Installed by setup_env.sh as ``disagg_nixl_hook.py`` beside ``engine_site.py`` (as
``disagg_engine_site``), with a ``.pth`` line that has the latter load it at every
interpreter start of the engine venv (never the sidecar's venv). Each part acts only
when its variable is set (the test harness sets both):

``DISAGG_NIXL_PTHR_DELAY_US``: NIXL's progress-thread poll delay. NIXL's Python wrapper
(``nixl_agent``) builds its agent config with ``pthrDelay = 0``, so the UCX progress thread
of every idle NIXL instance spins a whole core; on a 2-core test machine two idle vLLM
engines with a NIXL connector saturate both cores and slow everything several times over.
The wrapper does not expose the knob, so the binding's ``nixlAgent`` constructor is wrapped
to set ``pthrDelay`` on the config just before the agent is made. Transfers still work, idle
CPU is 0, and each progress poll may wait up to the delay.

``DISAGG_NIXL_KEEP_CORES=1``: the NIXL worker stays on the cores its engine was pinned to.
vLLM 0.32's NIXL worker on CPU moves the thread that builds it (the worker's main thread,
which also runs the model) to the last core of each NUMA node
(``nixl/base_worker.py:700-714``, "setup one last core in each numa for kv transfer"), and
every thread it starts after that (NIXL's progress thread, the push writer, the handshake
threads) inherits that core. On a 2-core machine that is core 1 for every NIXL engine,
whatever ``VLLM_CPU_OMP_THREADS_BIND`` says: a push prefill pinned to core 0 ran on core 1
beside its push decode, whose worker spin-waits a whole core while its request waits for the
KV, and the prefill starved (requests of 5 s to minutes). The hook makes vLLM's NUMA
discovery for that reservation return no cores, so the worker keeps its own.

How: ``engine_site``'s finder waits for the module to patch (the NIXL binding,
``nixl_cu12/13`` or ``nixl_rocm``'s ``_bindings``; ``vllm.platforms.cpu``) to be imported,
lazily (nothing is imported at start-up), and patches it right after it loads.

Deliberate limits: does nothing at all without the variables; knows the binding module names
of the nixl 1.5 wheels and vLLM 0.32's ``CpuPlatform.discover_numa_topology``, which only
that reservation calls.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

ENV_VAR = "DISAGG_NIXL_PTHR_DELAY_US"
KEEP_CORES_VAR = "DISAGG_NIXL_KEEP_CORES"
_BINDING_MODULES = frozenset({"nixl_cu12._bindings", "nixl_cu13._bindings", "nixl_rocm._bindings"})
_CPU_PLATFORM_MODULE = "vllm.platforms.cpu"


def _say(message: str) -> None:
    print(f"disagg_nixl_hook: {message}", file=sys.stderr, flush=True)


def _patch_delay(module: ModuleType, delay_us: int) -> None:
    original: Callable[..., Any] = getattr(module, "nixlAgent")  # noqa: B009 - a binding

    def nixl_agent_with_delay(name: str, config: Any, *rest: Any) -> Any:
        config.pthrDelay = delay_us
        return original(name, config, *rest)

    setattr(module, "nixlAgent", nixl_agent_with_delay)  # noqa: B010 - a binding
    _say(f"NIXL pthrDelay={delay_us}us")


def _patch_keep_cores(module: ModuleType) -> None:
    def no_cores_reserved_for_kv(cls: type) -> list[list[int]]:
        cores = sorted(os.sched_getaffinity(0))
        _say(f"NIXL worker keeps its cores {cores} (no core reserved for KV transfer)")
        return []

    module.CpuPlatform.discover_numa_topology = classmethod(no_cores_reserved_for_kv)


def patches() -> dict[str, Callable[[ModuleType], None]]:
    """``engine_site``'s patches: those whose variables are set."""
    patches: dict[str, Callable[[ModuleType], None]] = {}
    raw = os.environ.get(ENV_VAR, "")
    if raw:
        try:
            delay_us = int(raw)
        except ValueError:
            _say(f"ignoring non-integer {ENV_VAR}={raw!r}")
        else:
            for name in _BINDING_MODULES:
                patches[name] = lambda module: _patch_delay(module, delay_us)
    if os.environ.get(KEEP_CORES_VAR) == "1":
        patches[_CPU_PLATFORM_MODULE] = _patch_keep_cores
    return patches

