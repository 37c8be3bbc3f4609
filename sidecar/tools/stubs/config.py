"""The stub engine's configuration: one frozen dataclass, the same for every engine flavour.

Deliberate limits: checks only what would make the stub meaningless (an unknown engine,
role, connector or query shape); everything else is trusted test input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from sidecar.stubs.faults import Fault

ENGINES: Final = ("vllm", "sglang", "trtllm")
ROLES: Final = ("prefill", "decode", "both")
VLLM_CONNECTORS: Final = ("shfs", "nixl", "mooncake")
MOONCAKE_QUERY_SHAPES: Final = ("dp_rank", "engine_id")


@dataclass(frozen=True)
class StubConfig:
    """What one stub engine is and how it behaves.

    ``kv_connector`` applies to vLLM only: ``shfs`` (NixlConnector, pull), ``nixl`` (the
    Neuron fork: ``disagg_prefill_resp``), ``mooncake`` (MooncakeConnector, push).
    ``port``/``bootstrap_port`` 0 means OS-chosen. Timeouts are in seconds.
    """

    engine: str = "vllm"
    role: str = "both"
    kv_connector: str = "shfs"
    host: str = "127.0.0.1"
    port: int = 0
    bootstrap_port: int = 0
    model: str = "stub-model"
    max_model_len: int = 4096
    default_max_tokens: int = 16
    block_size: int = 16
    eos_rate: int = 0
    # Latency shaping (0 = as fast as possible): before the first token, between tokens.
    ttft_s: float = 0.0
    itl_s: float = 0.0
    # vLLM NIXL: how long a prefill holds blocks for a decode (VLLM_NIXL_ABORT_REQUEST_TIMEOUT).
    kv_lease_s: float = 480.0
    # Decode -> prefill KV pull (NIXL) and bootstrap queries (Mooncake, SGLang): connect/read.
    pull_timeout_s: float = 5.0
    # SGLang: prefill waits for its decode; decode (and vLLM Mooncake decode) waits for prefill.
    bootstrap_timeout_s: float = 30.0
    waiting_timeout_s: float = 30.0
    mooncake_query_shape: str = "dp_rank"
    # vLLM NIXL: the host a prefill names in its hand-off (VLLM_NIXL_SIDE_CHANNEL_HOST,
    # default "localhost"). Set e.g. "127.0.0.2" (nothing listens) to model the cross-pod
    # case, where only a sidecar that rewrites remote_host gets a working pull.
    side_channel_host: str = "localhost"
    # vLLM's uvicorn keeps idle connections 5 s; a pool that keeps them longer gets resets.
    keepalive_s: float = 5.0
    # How many requests the recorder keeps (oldest dropped); 0 disables recording bodies.
    record_limit: int = 10_000
    faults: tuple[Fault, ...] = field(default_factory=tuple)
    # Shared secret of all stubs of a "deployment" (TRT-LLM opaque state, like a build hash).
    secret: str = "disagg-stub"

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; known: {', '.join(ENGINES)}")
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; known: {', '.join(ROLES)}")
        if self.engine == "vllm" and self.kv_connector not in VLLM_CONNECTORS:
            raise ValueError(
                f"unknown vLLM connector {self.kv_connector!r}; known: {', '.join(VLLM_CONNECTORS)}"
            )
        if self.mooncake_query_shape not in MOONCAKE_QUERY_SHAPES:
            raise ValueError(
                f"unknown mooncake query shape {self.mooncake_query_shape!r}; "
                f"known: {', '.join(MOONCAKE_QUERY_SHAPES)}"
            )
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")

    @property
    def has_bootstrap_server(self) -> bool:
        """Prefill engines that rendezvous through a bootstrap server run one."""
        if self.role == "decode":
            return False
        mooncake = self.engine == "vllm" and self.kv_connector == "mooncake"
        return self.engine == "sglang" or mooncake
