"""The stub engine's configuration: one frozen dataclass, the same for every engine flavour
and both transports (``aiohttp``: every engine, fault switches, recording; ``lean``: the
benchmark's cheap one, vLLM NIXL and SGLang completions only).

Deliberate limits: a vLLM NIXL decode stub pulls its KV from the prefill stub's engine port
over plain HTTP, so a TLS prefill stub serves SGLang, TensorRT-LLM and Mooncake pairs (whose
peers meet on the plain bootstrap port, or not at all) but not a NIXL pull; checks only what
would make the stub meaningless (an unknown engine,
role, connector, query shape or transport, or what the lean transport does not serve);
everything else is trusted test input.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Final

from sidecar.tools.stubs.faults import Fault

ENGINES: Final = ("vllm", "sglang", "trtllm")
ROLES: Final = ("prefill", "decode", "both")
VLLM_CONNECTORS: Final = ("shfs", "nixl", "mooncake", "nixl-push")
MOONCAKE_QUERY_SHAPES: Final = ("dp_rank", "engine_id")
TRANSPORTS: Final = ("aiohttp", "lean")
STREAM_WRITES: Final = ("event", "whole")
# The one dispatch by engine name, for both transports: (transport, engine) -> "module:Class",
# imported on first use (an engine module imports its transport's server for its helpers).
_FLAVOURS: Final = {
    ("aiohttp", "vllm"): "sidecar.tools.stubs.vllm:VllmEngine",
    ("aiohttp", "sglang"): "sidecar.tools.stubs.sglang:SglangEngine",
    ("aiohttp", "trtllm"): "sidecar.tools.stubs.trtllm:TrtllmEngine",
    ("lean", "vllm"): "sidecar.tools.stubs.lean.vllm:VllmFlavour",
    ("lean", "sglang"): "sidecar.tools.stubs.lean.sglang:SglangFlavour",
}


@dataclass(frozen=True)
class StubConfig:
    """What one stub engine is and how it behaves.

    ``kv_connector`` applies to vLLM only: ``shfs`` (NixlConnector, pull), ``nixl`` (the
    Neuron fork: ``disagg_prefill_resp``), ``mooncake`` (MooncakeConnector, push),
    ``nixl-push`` (NixlPushConnector).
    ``port``/``bootstrap_port`` 0 means OS-chosen. Timeouts are in seconds.
    """

    engine: str = "vllm"
    role: str = "both"
    kv_connector: str = "shfs"
    host: str = "127.0.0.1"
    port: int = 0
    bootstrap_port: int = 0
    model: str = "stub-model"
    # Where the served model's weights came from, as ``/v1/models`` says it (``root``; vLLM:
    # its --model); None: the model name. Another revision under the same name differs here.
    model_root: str | None = None
    # vLLM: the KV cache's dtype, as ``/metrics``' ``vllm:cache_config_info`` states it.
    kv_cache_dtype: str = "auto"
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
    # Data-parallel ranks behind the one API server (``ranks``): each request runs on the rank
    # it names (vLLM's header, SGLang's routed_dp_rank) or the next in turn, and the rank's
    # KV identity is what its hand-off names.
    data_parallel_size: int = 1
    # vLLM's uvicorn keeps idle connections 5 s; a pool that keeps them longer gets resets.
    keepalive_s: float = 5.0
    # How many requests the recorder keeps (oldest dropped); 0 disables recording bodies.
    record_limit: int = 10_000
    faults: tuple[Fault, ...] = field(default_factory=tuple)
    # Shared secret of all stubs of a "deployment" (TRT-LLM opaque state, like a build hash).
    secret: str = "disagg-stub"
    # Which server carries the behaviour: "aiohttp" (tests) or "lean" (the benchmark).
    transport: str = "aiohttp"
    # The lean transport's unpaced streams: a write per event, as an engine's server does
    # ("event"), or head, events and end in one write ("whole": the bytecode count's stubs,
    # whose streams then reach the sidecar in one read whatever the machine's timing).
    stream_writes: str = "event"
    # Serve /_stub/faults (faults switched over HTTP by another process): off unless asked.
    control_faults: bool = False
    # HTTPS on the engine port (both PEM files; the bootstrap port stays plain HTTP, as the
    # engines' bootstrap servers are), asking for a client certificate signed by
    # ``tls_client_ca_file`` when that is set (mutual TLS, as an engine behind a mesh).
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None
    # vLLM --enable-prompt-tokens-details: usage reports the prefix cache's figures.
    prompt_tokens_details: bool = False
    # vLLM --enable-scale-out: /inference/v1/generate is served (else 403, as vLLM 0.32).
    scale_out: bool = True
    # vLLM: the prefix cache's size in blocks (least recently used evicted first), and where
    # its KV events go (--kv-events-config's endpoint and topic; None: not published).
    kv_cache_blocks: int = 4096
    kv_events_endpoint: str | None = None
    kv_events_topic: str = ""

    @property
    def root(self) -> str:
        """The model's ``root`` in ``/v1/models``."""
        return self.model_root if self.model_root is not None else self.model

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
        if self.data_parallel_size < 1:
            raise ValueError("data_parallel_size must be >= 1")
        if self.kv_cache_blocks < 1:
            raise ValueError("kv_cache_blocks must be >= 1")
        if self.kv_events_endpoint is not None and self.engine != "vllm":
            raise ValueError("kv_events_endpoint: the vLLM stub publishes KV events, not "
                             f"{self.engine!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"unknown transport {self.transport!r}; known: {', '.join(TRANSPORTS)}"
            )
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file: set both or neither")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file")
        if self.stream_writes not in STREAM_WRITES:
            raise ValueError(f"unknown stream_writes {self.stream_writes!r}; known: "
                             f"{', '.join(STREAM_WRITES)}")
        if self.transport == "lean":
            self._check_lean()
        elif self.stream_writes != "event":
            raise ValueError("stream_writes: the lean transport's only")

    def _check_lean(self) -> None:
        if self.engine not in ("vllm", "sglang"):
            raise ValueError(
                f"the lean transport serves vllm and sglang, not {self.engine!r}"
            )
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"the lean transport serves prefill or decode, not {self.role!r}")
        if self.engine == "vllm" and self.kv_connector != "shfs":
            raise ValueError("the lean vLLM engine speaks NixlConnector (shfs) only")
        if self.faults or self.eos_rate or self.control_faults:
            raise ValueError("the lean transport has no fault switches or EOS")
        if self.tls_cert_file is not None:
            raise ValueError("the lean transport serves plain HTTP only")
        if self.data_parallel_size != 1:
            raise ValueError("the lean transport has one data-parallel rank")
        if self.kv_events_endpoint is not None:
            raise ValueError("the lean transport publishes no KV events")

    @property
    def has_bootstrap_server(self) -> bool:
        """Prefill engines that rendezvous through a bootstrap server run one."""
        if self.role == "decode":
            return False
        mooncake = self.engine == "vllm" and self.kv_connector == "mooncake"
        return self.engine == "sglang" or mooncake


def flavour_class(config: StubConfig) -> Any:
    """The class that plays ``config.engine`` on ``config.transport`` (checked at init)."""
    module, _, name = _FLAVOURS[(config.transport, config.engine)].partition(":")
    return getattr(importlib.import_module(module), name)
