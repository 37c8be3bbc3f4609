"""The sidecar's configuration: one frozen object, built once at start.

Precedence, highest first: command-line flags > environment ``DISAGG_*`` > the pod's labels
and annotations (downward-API files under ``--podinfo-dir``) > defaults. The loader that
applies it lives in ``sidecar.config.loader``; this module defines the fields and checks each
value on its own (types, ranges, names, URL shapes, allowlist entries).

Every field has a ``description``: it is the flag's help text and a row of the generated
configuration reference (``sidecar.config.docs``), so a field without one fails a test.
``POD_SOURCES`` names the fields a pod label or annotation can set, and which field holds the
key; ``EXTRA_ENV`` names environment variables read besides ``DISAGG_<FIELD>``.

The fields are the sidecar's own (``ServingSettings``, ``LimitsSettings``,
``DataParallelSettings``, ``TLSSettings``, ``KVEventsSettings``)
plus each dialect's ``Options`` (``sidecar.dialects``: an engine's bootstrap port, id machine,
...): ``Settings`` is composed from them once, at import, so a dialect's settings get flags,
environment variables, pod sources and reference rows like every other, and no engine is
named here.
For the type checker ``Settings`` is the sidecar's own part; a dialect reads its fields
through its ``Options.of(settings)``.

Deliberate limits: checks that relate two fields or import plug-ins (same port twice, a
connector for an engine it does not serve) live in the loader, where the source of each value
is known and can be named in the message.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import TYPE_CHECKING, Final

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sidecar.config.cores import auto_workers
from sidecar.config.data_parallel import DATA_PARALLEL_POD_SOURCES, DataParallelSettings
from sidecar.config.kv_events_settings import KV_EVENTS_POD_SOURCES, KVEventsSettings
from sidecar.config.limits import LimitsSettings, PrefillFailurePolicy, PromptLengthSource
from sidecar.config.tls_settings import TLSSettings
from sidecar.config.urls import check_engine_url, check_prefill_url
from sidecar.dialects import DEFAULT_CONNECTOR, DEFAULT_ENGINE, DIALECTS
from sidecar.dialects.base import PodSource
from sidecar.observability.otlp import check_endpoint
from sidecar.targets.allowlist import parse_entry


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


class KVTransport(StrEnum):
    """How the gRPC front door moves KV: engine-native hand-off, or bytes in the stream."""

    NATIVE = "native"
    INLINE = "inline"


LOG_LEVELS: Final = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS: Final = ("text", "json")


#: The most workers one sidecar runs: each keeps 4096 // count snowflake ids per millisecond
#: (64 at this bound, far above what one Python worker serves); see the dialects' id sources.
MAX_WORKERS: Final = 64

#: The sidecar's own fields a pod label can set (the loader reads each its own way).
CORE_POD_SOURCES: Final[Mapping[str, PodSource]] = MappingProxyType(
    {
        "engine": PodSource("label", "engine_label"),
        "kv_connector": PodSource("label", "kv_connector_label"),
        "engine_url": PodSource("label", "port_label", "port"),
        "role": PodSource("label", "role_label"),
    }
)

#: Environment variables read after ``DISAGG_<FIELD>`` (Kubernetes commonly injects POD_IP).
EXTRA_ENV: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType(
    {"advertise_host": ("POD_IP",)}
)


class ServingSettings(BaseModel):
    """The sidecar's own settings (no engine's): what it serves, where, within which limits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # What runs next to us.
    engine: str = Field(
        default=DEFAULT_ENGINE,
        description=f"The local engine: {', '.join(DIALECTS.engines())} (case-insensitive). "
        "Another name refuses to start, naming the closest, unless "
        "--allow-unregistered-engine.",
    )
    allow_unregistered_engine: bool = Field(
        default=False,
        description="Serve an engine name no dialect is registered for with the default "
        "dialect: plain prefill then decode, no hand-off, so each leg computes the whole "
        "prompt. Off: such a name refuses to start.",
    )
    kv_connector: str = Field(
        default=DEFAULT_CONNECTOR,
        description=f"The KV connector type of engines that have several "
        f"({', '.join(DIALECTS.connectors())}: AIBrix's label values; the engine's own "
        "connector class names are accepted too: "
        f"{', '.join(f'{a} = {c}' for a, c in sorted(DIALECTS.connector_aliases().items()))}; "
        "case-insensitive). An unknown or missing label value falls back to "
        "--default-kv-connector with a warning; an unknown value given by flag or env refuses "
        "to start.",
    )
    default_kv_connector: str = Field(
        default=DEFAULT_CONNECTOR,
        description="The connector used when the pod label is missing or unknown.",
    )
    engine_url: str = Field(
        default="http://127.0.0.1:8000",
        description="Base URL of the local engine: http(s)://HOST[:PORT], no path (the "
        "sidecar adds /v1/... and /health) and no query. From the port label it is "
        "http://127.0.0.1:PORT.",
    )
    role: Role = Field(
        default=Role.BOTH,
        description="This sidecar's role: prefill, decode or both (case-insensitive). From the "
        "label, any value other than prefill or decode means both.",
    )
    advertise_host: str | None = Field(
        default=None,
        description="The address peers use to reach this pod's engine (hand-off host); "
        "falls back to env POD_IP.",
    )

    # Where we listen.
    host: str = Field(default="0.0.0.0", description="Address the HTTP and gRPC servers bind.")
    port: int = Field(
        default=8080, ge=0, le=65535, description="HTTP port (0: chosen by the OS)."
    )
    grpc_enabled: bool = Field(default=True, description="Serve the gRPC front door.")
    grpc_port: int = Field(
        default=50051, ge=0, le=65535, description="gRPC port (0: chosen by the OS)."
    )
    grpc_max_message_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1024, description="Largest gRPC message, each direction."
    )
    metrics_port: int | None = Field(
        default=None,
        ge=0, le=65535,
        description="Separate Prometheus port (0: chosen by the OS); unset: /metrics on the "
        "HTTP port.",
    )
    ports_file: str | None = Field(
        default=None,
        description="Write the bound ports as JSON to this file once listening (for tests and "
        "port 0).",
    )

    workers: int = Field(
        default=1,
        ge=1,
        le=MAX_WORKERS,
        description="Processes serving the same HTTP and gRPC ports (SO_REUSEPORT), each with "
        f"its own event loop and engine connections; auto: the cores the container may use "
        f"(CPU affinity and cgroup quota), as many as its memory limit holds (96 MiB each), "
        f"1..{MAX_WORKERS}, and 1 with --kv-events-endpoint; the container image sets auto. "
        "One supervisor restarts a worker "
        "that dies; /metrics and --max-inflight cover them all.",
    )

    # Pod information.
    podinfo_dir: str | None = Field(
        default=None,
        description="Downward-API directory holding the files labels and annotations "
        "(e.g. /etc/podinfo); unset: labels are not read.",
    )
    engine_label: str = Field(
        default="model.aibrix.ai/engine", min_length=1, description="Label naming the engine."
    )
    kv_connector_label: str = Field(
        default="model.aibrix.ai/kv-connector-type",
        min_length=1,
        description="Label naming the KV connector type.",
    )
    port_label: str = Field(
        default="model.aibrix.ai/port",
        min_length=1,
        description="Label holding the local engine's port.",
    )
    role_label: str = Field(
        default="role-name", min_length=1, description="Label holding the pod's role."
    )

    # Prefill targets.
    prefill_urls: tuple[str, ...] = Field(
        default=(),
        description="Static prefill pool, each http(s)://host:port with nothing else; used "
        "when a request names no prefill host (https: TLS verified against --engine-ca-file "
        "and the entry's host name). Repeat the flag; comma-separated in env.",
    )
    prefill_allowlist: tuple[str, ...] = Field(
        default=(),
        description="Prefill targets a router may name: HOST:PORT, HOST:*, CIDR:PORT, CIDR:* "
        "(IPv6 in brackets); comma-separated, the flag repeatable. Empty: only the static "
        "pool. Entries match literally: a host name admits a router naming that name, never "
        "one naming its address (names are not resolved; localhost:8100 does not admit "
        "127.0.0.1:8100), and says so at start.",
    )

    prefill_pod_selector: str | None = Field(
        default=None,
        description="Kubernetes mode: label selector of the prefill pods a router may name "
        "(e.g. role-name=prefill); each Running pod's IP with its port label (default 8000) "
        "joins the allowlist, kept current by a watch. Needs get/list/watch on pods.",
    )
    prefill_pod_namespace: str | None = Field(
        default=None,
        description="Kubernetes mode: namespace of the prefill pods; unset: this pod's own.",
    )

    # gRPC KV transport.
    kv_transport: KVTransport = Field(
        default=KVTransport.NATIVE,
        description="gRPC KV hand-off: native (engines move KV) or inline (KV bytes in the "
        "stream, through this project's KV connector in the engine).",
    )
    max_staged_bytes: int = Field(
        default=1024 * 1024 * 1024,
        ge=0,
        description="Inline mode: KV bytes staged at once (by each worker).",
    )
    max_kv_blocks: int = Field(
        default=100_000, ge=1, description="Inline mode: KV blocks accepted per request."
    )
    kv_block_bytes: int = Field(
        default=2 * 1024 * 1024,
        ge=1,
        le=1024 * 1024 * 1024,
        description="Inline mode, prefill: K+V bytes per KV block streamed: each block carries "
        "as many consecutive engine pages of one layer as fit, at least one (below one page: "
        "one page per block, as earlier versions sent), never more than --grpc-max-message-bytes "
        "less 4 KiB allows. Decode accepts any block size.",
    )
    kv_staging_dir: str = Field(
        default="/dev/shm/disagg-kv",
        description="Inline mode: directory shared with the engine's SidecarKVConnector "
        "(its staging_dir; a memory-backed volume) where KV is handed over.",
    )

    # Tracing (optional).
    otlp_endpoint: str | None = Field(
        default=None,
        description="OpenTelemetry collector for the sidecar's request spans; unset: tracing "
        "off. grpc://HOST:PORT or grpcs://HOST:PORT: OTLP/gRPC (plaintext or TLS); "
        "http(s)://HOST[:PORT][/PATH]: OTLP/HTTP (path default /v1/traces). OTEL_SERVICE_NAME, "
        "OTEL_RESOURCE_ATTRIBUTES and OTEL_TRACES_SAMPLER(_ARG) apply.",
    )

    # Logging.
    log_level: str = Field(
        default="info", description="Log level: debug, info, warning, error, critical."
    )
    log_format: str = Field(default="text", description="Log format: text or json.")

    @model_validator(mode="before")
    @classmethod
    def _workers_auto(cls, values: object) -> object:
        # auto: the container's cores and memory, but one process where one must hold the
        # KV-event index (check_kv_events refuses an explicit count above 1 there).
        if not isinstance(values, dict):
            return values
        workers = values.get("workers")
        if isinstance(workers, str) and workers.strip().lower() == "auto":
            one = bool(values.get("kv_events_endpoint"))
            values = {**values, "workers": 1 if one else min(auto_workers(), MAX_WORKERS)}
        return values

    @field_validator("engine")
    @classmethod
    def _engine_name(cls, value: str) -> str:
        name = value.strip().lower()
        if not name:
            raise ValueError("engine name is empty")
        return name

    @field_validator("kv_connector", "default_kv_connector")
    @classmethod
    def _connector_name(cls, value: str) -> str:
        name = DIALECTS.connector_name(value)
        valid = DIALECTS.connectors()
        if name not in valid:
            aliases = ", ".join(sorted(DIALECTS.connector_aliases()))
            raise ValueError(
                f"unknown kv connector {value!r}; valid: {', '.join(valid)} (or {aliases})"
            )
        return name

    @field_validator("engine_url")
    @classmethod
    def _engine_url(cls, value: str) -> str:
        return check_engine_url(value)

    @field_validator("prefill_urls")
    @classmethod
    def _prefill_urls(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for url in value:
            check_prefill_url(url)
        return value

    @field_validator("prefill_allowlist")
    @classmethod
    def _allowlist(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for entry in value:
            parse_entry(entry)
        return value

    @field_validator("otlp_endpoint")
    @classmethod
    def _otlp_endpoint(cls, value: str | None) -> str | None:
        return None if value is None else check_endpoint(value)

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, value: str) -> str:
        level = value.strip().lower()
        if level not in LOG_LEVELS:
            raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}")
        return level

    @field_validator("log_format")
    @classmethod
    def _log_format(cls, value: str) -> str:
        fmt = value.strip().lower()
        if fmt not in LOG_FORMATS:
            raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}")
        return fmt


class _Settings(KVEventsSettings, TLSSettings, DataParallelSettings, LimitsSettings,
                ServingSettings):
    """Every setting of one sidecar process that is not a dialect's; immutable once built."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def _composed() -> type[_Settings]:
    """``_Settings`` with every registered dialect's options (theirs after the sidecar's)."""
    options = DIALECTS.option_models()
    own = set(_Settings.model_fields)
    for model in options:
        clash = own & set(model.model_fields)
        if clash:
            raise RuntimeError(
                f"dialect options {model.__qualname__} redefine setting(s) {sorted(clash)}"
            )
    # Fields are collected from the last base first: the sidecar's own come first.
    bases: tuple[type[BaseModel], ...] = (*reversed(options), _Settings)
    namespace = {"__module__": __name__, "__doc__": _Settings.__doc__,
                 "__qualname__": "Settings",
                 "model_config": ConfigDict(frozen=True, extra="forbid")}
    composed: type[_Settings] = type("Settings", bases, namespace)
    return composed


if TYPE_CHECKING:
    Settings = _Settings
else:
    Settings = _composed()

#: Fields a pod label or annotation can set (below flags and env, above defaults).
POD_SOURCES: Final[Mapping[str, PodSource]] = MappingProxyType({
    **CORE_POD_SOURCES,
    **DATA_PARALLEL_POD_SOURCES,
    **KV_EVENTS_POD_SOURCES,
    **{name: source for model in DIALECTS.option_models()
       for name, source in model.pod_sources.items()},
})

__all__ = [
    "EXTRA_ENV",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "MAX_WORKERS",
    "POD_SOURCES",
    "KVTransport",
    "PrefillFailurePolicy",
    "PromptLengthSource",
    "Role",
    "Settings",
    "check_prefill_url",
]
