"""The set of real engines one test session shares, and how it is started.

Owns the shape of the real-vLLM stack: one baseline engine (no connector), a NIXL pair
(prefill ``kv_producer`` + decode ``kv_consumer``, CPU buffer) and an ExampleConnector pair
(both ``kv_both`` on one shared storage dir), all started at once and waited for together.

    start_stack(group) -> RealVllm(baseline, nixl=PdPair, example=PdPair, ...)

Why five engines at once: start-up is CPU-bound (about 25 CPU-seconds each), so on two cores
starting them together finishes as early as any phasing would, and idle engines cost no CPU
once NIXL's progress thread is tamed (nixl_hook.py). Memory is about 2 GiB per engine.

The baseline and the NIXL pair run with ``harness.ROUTE_FLAGS`` (``/inference/v1/generate``
served, usage with prompt-cache figures): every PD route of the sidecar can be compared with
the baseline on them.

Deliberate limits: decode engines run without prefix caching, so every decode pulls its KV
afresh whatever ran before (tests stay independent of order, and a deliberately corrupted
transfer cannot poison later tests); prefill engines keep vLLM's default.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from real_vllm.harness import (
    ROUTE_FLAGS,
    SERVED_MODEL_NAME,
    Engine,
    EngineEnv,
    EngineGroup,
    EngineSpec,
    example_config,
    nixl_config,
)

BASELINE = "baseline"
NIXL_PREFILL = "nixl-prefill"
NIXL_DECODE = "nixl-decode"
EXAMPLE_PREFILL = "example-prefill"
EXAMPLE_DECODE = "example-decode"


@dataclass(frozen=True)
class PdPair:
    """A prefill engine and a decode engine that share one KV connector."""

    connector: str
    prefill_engine: Engine
    decode_engine: Engine

    @property
    def prefill(self) -> str:
        """Base URL of the prefill engine, e.g. ``http://127.0.0.1:41234``."""
        return self.prefill_engine.url

    @property
    def decode(self) -> str:
        """Base URL of the decode engine."""
        return self.decode_engine.url

    @property
    def prefill_hostport(self) -> str:
        """``host:port`` of the prefill engine (what ``x-prefiller-host-port`` carries)."""
        return f"127.0.0.1:{self.prefill_engine.port}"


@dataclass(frozen=True)
class RealVllm:
    """Everything a real-vLLM test needs: URLs, the engine venv, the served model name."""

    env: EngineEnv
    baseline_engine: Engine
    nixl: PdPair
    example: PdPair
    example_storage: Path
    model: str = SERVED_MODEL_NAME

    @property
    def baseline(self) -> str:
        """Base URL of the engine without any KV connector (the reference output)."""
        return self.baseline_engine.url

    @property
    def engine_python(self) -> Path:
        """The engine venv's interpreter, for running small scripts against vLLM itself."""
        return self.env.python

    @property
    def vllm_version(self) -> str:
        return self.env.vllm_version

    def engines(self) -> list[Engine]:
        return [
            self.baseline_engine,
            self.nixl.prefill_engine,
            self.nixl.decode_engine,
            self.example.prefill_engine,
            self.example.decode_engine,
        ]


def stack_specs(storage: Path) -> list[EngineSpec]:
    # Cores alternate so that concurrent work (a prefill and its decode) runs on both.
    return [
        EngineSpec(BASELINE, None, cpu=0, extra_args=ROUTE_FLAGS),
        EngineSpec(NIXL_PREFILL, nixl_config("kv_producer"), cpu=0, extra_args=ROUTE_FLAGS),
        EngineSpec(NIXL_DECODE, nixl_config("kv_consumer"), cpu=1, prefix_caching=False,
                   extra_args=ROUTE_FLAGS),
        EngineSpec(EXAMPLE_PREFILL, example_config(storage), cpu=1),
        EngineSpec(EXAMPLE_DECODE, example_config(storage), cpu=0, prefix_caching=False),
    ]


def start_stack(group: EngineGroup) -> RealVllm:
    """Start the five engines of the stack in ``group`` and wait until all are healthy."""
    storage = group.root / "example-storage"
    storage.mkdir()
    engines = group.start(stack_specs(storage))
    return RealVllm(
        env=group.env,
        baseline_engine=engines[BASELINE],
        nixl=PdPair("NixlConnector", engines[NIXL_PREFILL], engines[NIXL_DECODE]),
        example=PdPair("ExampleConnector", engines[EXAMPLE_PREFILL], engines[EXAMPLE_DECODE]),
        example_storage=storage,
    )
