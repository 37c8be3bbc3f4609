"""The settings by topic: how ``serve --help`` and ``config --help`` group their flags.

    group_of("prefill_allowlist") -> "prefill targets"

Each group names the fields it holds; fields a later change adds land by prefix (placement
settings such as ``local_prefill_*``), a dialect's own settings land in "engine-specific",
and anything else in "other" (``tests/test_cli.py`` checks that none of today's fields is
there, so a new one is placed on purpose).
"""

from __future__ import annotations

from typing import Final, NamedTuple

from sidecar.dialects import DIALECTS


class FlagGroup(NamedTuple):
    title: str
    description: str
    fields: tuple[str, ...]
    #: Field-name prefixes also placed here, for fields not named by any group.
    prefixes: tuple[str, ...] = ()


FLAG_GROUPS: Final[tuple[FlagGroup, ...]] = (
    FlagGroup("engine", "the local engine, its KV connector and this sidecar's role", (
        "engine", "allow_unregistered_engine", "kv_connector", "default_kv_connector",
        "engine_url", "role", "advertise_host")),
    FlagGroup("listening", "where the sidecar listens", (
        "host", "port", "metrics_port", "ports_file")),
    FlagGroup("prefill targets", "where prefill legs may go, and what happens when one fails", (
        "prefill_urls", "prefill_allowlist", "prefill_pod_selector", "prefill_pod_namespace",
        "prefill_cooldown_s", "prefill_breaker_failures", "prefill_breaker_open_s",
        "prefill_breaker_successes", "on_prefill_failure", "trusted_router")),
    FlagGroup("migration", "a request whose engine dies after its answer began, moved to "
              "another engine", ("migration_limit", "migration_urls",
                                 "migration_max_stream_bytes"), prefixes=("migration_",)),
    FlagGroup("placement", "which requests are disaggregated, and how they fan out", (
        "local_prefill_max_tokens", "prompt_length_source", "tokenize_timeout_s", "max_fanout"),
        prefixes=("local_prefill_", "kv_events_", "placement_")),
    FlagGroup("data-parallel engines", "ranks of the local and the prefill engines", (
        "data_parallel_size", "prefill_data_parallel_size")),
    FlagGroup("limits and timeouts", "bodies, in-flight requests and upstream deadlines", (
        "max_body_bytes", "max_body_inflation", "max_inflating_body_bytes",
        "client_body_timeout_s", "client_header_timeout_s",
        "max_prefill_response_bytes", "max_inflight", "connect_timeout_s", "read_timeout_s",
        "prefill_timeout_s", "keepalive_s", "max_connections", "drain_grace_s")),
    FlagGroup("TLS", "serving TLS and mutual TLS; TLS to engines", (
        "tls_cert_file", "tls_key_file", "tls_reload_interval_s", "tls_client_ca_file",
        "engine_ca_file", "engine_client_cert_file", "engine_client_key_file")),
    FlagGroup("gRPC front door", "the gRPC services and the inline KV transport", (
        "grpc_enabled", "grpc_port", "grpc_max_message_bytes", "kv_transport",
        "max_staged_bytes", "max_kv_blocks", "kv_block_bytes", "kv_staging_dir")),
    FlagGroup("workers", "several processes on the same ports", ("workers",)),
    FlagGroup("observability", "logs and traces (metrics: /metrics, --metrics-port)", (
        "log_level", "log_format", "otlp_endpoint")),
    FlagGroup("pod labels", "reading the pod's labels and annotations (downward API)", (
        "podinfo_dir", "engine_label", "kv_connector_label", "port_label", "role_label",
        "data_parallel_size_label", "prefill_data_parallel_size_label")),
)
ENGINE_SPECIFIC: Final = FlagGroup(
    "engine-specific", "settings a dialect adds for its engine", ())
OTHER: Final = FlagGroup("other", "settings not placed in a group", ())


def _dialect_fields() -> frozenset[str]:
    return frozenset(name for model in DIALECTS.option_models() for name in model.model_fields)


def group_of(name: str) -> FlagGroup:
    """The group field ``name`` is shown in."""
    for group in FLAG_GROUPS:
        if name in group.fields:
            return group
    if name in _dialect_fields():
        return ENGINE_SPECIFIC
    for group in FLAG_GROUPS:
        if group.prefixes and name.startswith(group.prefixes):
            return group
    return OTHER


def grouped(names: list[str]) -> list[tuple[FlagGroup, list[str]]]:
    """``names`` by group, groups in display order, fields in their definition order."""
    order = [*FLAG_GROUPS, ENGINE_SPECIFIC, OTHER]
    members: dict[str, list[str]] = {group.title: [] for group in order}
    for name in names:
        members[group_of(name).title].append(name)
    return [(group, members[group.title]) for group in order if members[group.title]]
