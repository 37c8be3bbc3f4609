"""The sidecar's configuration: one frozen object, built once at start.

Precedence, highest first: command-line flags > environment ``DISAGG_*`` > the pod's labels
and annotations (downward-API files under ``--podinfo-dir``) > defaults. The loader that
applies it lives in ``sidecar.config_loader``; this module defines the fields and checks them.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


class PrefillFailurePolicy(StrEnum):
    """What a PD request does when its prefill leg fails."""

    FAIL = "fail"
    LOCAL = "local"


class KVTransport(StrEnum):
    """How the gRPC front door moves KV: engine-native hand-off, or bytes in the stream."""

    NATIVE = "native"
    INLINE = "inline"


class Settings(BaseModel):
    """Every setting of one sidecar process; immutable once built."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # What runs next to us.
    engine: str = "vllm"
    kv_connector: str = "shfs"
    default_kv_connector: str = "shfs"
    engine_url: str = "http://127.0.0.1:8000"
    role: Role = Role.BOTH
    sglang_bootstrap_port: int = Field(default=8998, ge=1, le=65535)
    mooncake_bootstrap_port: int = Field(default=8998, ge=1, le=65535)
    trtllm_machine_id: int = Field(default=0, ge=0, le=1023)
    advertise_host: str | None = None

    # Where we listen.
    host: str = "0.0.0.0"
    port: int = Field(default=8080, ge=0, le=65535)
    grpc_enabled: bool = True
    grpc_port: int = Field(default=50051, ge=0, le=65535)
    grpc_max_message_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    ports_file: str | None = None

    # Pod information.
    podinfo_dir: str | None = None
    engine_label: str = "model.aibrix.ai/engine"
    kv_connector_label: str = "model.aibrix.ai/kv-connector-type"
    port_label: str = "model.aibrix.ai/port"
    role_label: str = "role-name"
    sglang_bootstrap_port_annotation: str = "model.aibrix.ai/sglang-bootstrap-port"

    # Prefill targets.
    prefill_urls: tuple[str, ...] = ()
    prefill_allowlist: tuple[str, ...] = ()

    # Behaviour and limits.
    on_prefill_failure: PrefillFailurePolicy = PrefillFailurePolicy.FAIL
    trusted_router: bool = False
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    max_prefill_response_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    max_inflight: int = Field(default=1024, ge=1)
    connect_timeout_s: float = Field(default=5.0, gt=0)
    read_timeout_s: float = Field(default=300.0, gt=0)
    prefill_timeout_s: float = Field(default=30.0, gt=0)
    keepalive_s: float = Field(default=4.0, gt=0)
    max_connections: int = Field(default=1024, ge=1)
    drain_grace_s: float = Field(default=30.0, ge=0)

    # gRPC KV transport.
    kv_transport: KVTransport = KVTransport.NATIVE
    max_staged_bytes: int = Field(default=1024 * 1024 * 1024, ge=0)
    max_kv_blocks: int = Field(default=100_000, ge=1)

    # Logging.
    log_level: str = "info"
    log_format: str = "text"
