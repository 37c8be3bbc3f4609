"""The checks that relate several settings, each naming where every value came from.

    check_engine_registered  an engine name no dialect is registered for only when
                           allow_unregistered_engine says the default dialect is meant
    check_ports            no two listeners on one port, none on the local engine's
    check_tls              pairs set whole, a client CA only with a server pair, files load
    check_connector_engine a connector given by flag or env serves the engine
    check_prompt_length_source  ``tokenize`` only for an engine with a tokenizer endpoint
    check_tracing          an OTLP endpoint only with the tracing extra installed
    check_kv_events        KV-event endpoints on loopback unless allowed, one worker, one rank;
                           the replay endpoint and the cache rule only with an endpoint
    data_parallel_warning  data-parallel sizes for an engine that places ranks itself (a
                           warning, not a refusal: the engine still serves)
    empty_allowlist_warning  a decode sidecar without a static pool whose allowlist admits no
                           router-named target (a warning: every such request gets 403)
    allowlist_name_warnings  an allowlist entry naming a host: entries match literally, so it
                           never admits a router that names one of the host's addresses

Each check raises ``ConfigError``; the loader runs them after ``Settings`` checked each value
alone. Each warning function returns the warning's text (or nothing) for the caller to log.
"""

from __future__ import annotations

import difflib
from typing import Protocol
from urllib.parse import urlsplit

from sidecar.config.settings import PromptLengthSource, Role, Settings
from sidecar.dialects import DIALECTS, dialect_class
from sidecar.kv_events.endpoint import check_endpoint
from sidecar.observability.otlp import TRACING_EXTRA, missing_modules
from sidecar.protocol.context import is_loopback_host, url_port
from sidecar.targets.allowlist import parse_entry
from sidecar.tls import ReloadingServerTLS, TLSFileError, client_ssl_context


class ConfigError(Exception):
    """The configuration is invalid; the message names the value and its source."""


class Sources(Protocol):
    def source_of(self, name: str) -> str:
        """Where field ``name``'s value came from (a flag, a variable, a label, default)."""


def closest_hint(name: str, known: list[str]) -> str:
    """``" (did you mean 'x'?)"`` for the registered name closest to ``name``, or nothing."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_engine_registered(settings: Settings, sources: Sources) -> None:
    """An engine name no dialect is registered for is a typo until said otherwise: served by
    the default dialect, every request would run whole on both engines (no hand-off)."""
    engines = DIALECTS.engines()
    if settings.engine in engines or settings.allow_unregistered_engine:
        return
    raise ConfigError(
        f"engine {settings.engine!r} (from {sources.source_of('engine')}) is not registered"
        f"{closest_hint(settings.engine, engines)}; registered: {', '.join(engines)}. An "
        "engine without a dialect of its own runs with the default dialect (plain prefill "
        "then decode, no hand-off: each leg computes the whole prompt) only when asked: "
        "--allow-unregistered-engine (env DISAGG_ALLOW_UNREGISTERED_ENGINE)"
    )


def check_ports(settings: Settings, sources: Sources) -> None:
    parts = urlsplit(settings.engine_url)
    engine_port = url_port(parts)
    if settings.port and settings.port == engine_port and is_loopback_host(parts.hostname or ""):
        raise ConfigError(
            f"port {settings.port} (from {sources.source_of('port')}) is the local engine's port "
            f"in engine_url {settings.engine_url!r} (from {sources.source_of('engine_url')}); the "
            "sidecar and the engine cannot listen on the same port"
        )
    listeners = [("port", settings.port), ("metrics_port", settings.metrics_port)]
    if settings.grpc_enabled:
        listeners.insert(1, ("grpc_port", settings.grpc_port))
    seen: dict[int, str] = {}
    for name, port in listeners:
        if not port:  # None or 0 (the OS picks a free port)
            continue
        if port in seen:
            other = seen[port]
            raise ConfigError(
                f"{name} {port} (from {sources.source_of(name)}) equals {other} "
                f"(from {sources.source_of(other)}); each listener needs its own port"
            )
        seen[port] = name


def check_tls(settings: Settings, sources: Sources) -> None:
    """Both files of a pair or neither, a client CA only with a server pair, and every TLS
    file loads (the server's are checked again at each reload)."""
    cert, key = settings.tls_cert_file, settings.tls_key_file
    if (cert is None) != (key is None):
        raise ConfigError(
            f"tls_cert_file {cert!r} (from {sources.source_of('tls_cert_file')}) and tls_key_file "
            f"{key!r} (from {sources.source_of('tls_key_file')}): set both or neither"
        )
    client_cert, client_key = settings.engine_client_cert_file, settings.engine_client_key_file
    if (client_cert is None) != (client_key is None):
        raise ConfigError(
            f"engine_client_cert_file {client_cert!r} (from "
            f"{sources.source_of('engine_client_cert_file')}) and engine_client_key_file "
            f"{client_key!r} (from {sources.source_of('engine_client_key_file')}): set both or "
            "neither"
        )
    if settings.tls_client_ca_file is not None and cert is None:
        raise ConfigError(
            f"tls_client_ca_file (from {sources.source_of('tls_client_ca_file')}) needs "
            "tls_cert_file and tls_key_file: client certificates are asked for over TLS only"
        )
    try:
        if cert is not None and key is not None:
            ReloadingServerTLS(cert, key, client_ca_file=settings.tls_client_ca_file)
        if settings.engine_ca_file is not None or client_cert is not None:
            client_ssl_context(settings.engine_ca_file, client_cert, client_key)
    except TLSFileError as exc:
        raise ConfigError(str(exc)) from None


def check_connector_engine(settings: Settings, sources: Sources) -> None:
    source = sources.source_of("kv_connector")
    if not source.startswith(("flag ", "env ")):
        return  # a label or the default: used only where it applies, never refused
    engines = DIALECTS.engines_of(settings.kv_connector)
    if settings.engine not in engines:
        raise ConfigError(
            f"kv connector {settings.kv_connector!r} (from {source}) serves "
            f"{', '.join(sorted(engines))}, not engine {settings.engine!r} "
            f"(from {sources.source_of('engine')})"
        )


def check_prompt_length_source(settings: Settings, sources: Sources) -> None:
    if settings.prompt_length_source is not PromptLengthSource.TOKENIZE:
        return
    if dialect_class(settings.engine, settings.kv_connector).tokenize is None:
        having = sorted({engine for engine, connector in DIALECTS
                         if DIALECTS.get(engine, connector).tokenize is not None})
        raise ConfigError(
            f"prompt_length_source 'tokenize' (from {sources.source_of('prompt_length_source')}) "
            f"needs an engine with a tokenizer endpoint ({', '.join(having)}), not engine "
            f"{settings.engine!r} (from {sources.source_of('engine')}); use 'estimate'"
        )


def check_tracing(settings: Settings, sources: Sources) -> None:
    """Tracing needs the OpenTelemetry SDK and the endpoint's OTLP exporter (an extra)."""
    if settings.otlp_endpoint is None:
        return
    missing = missing_modules(settings.otlp_endpoint)
    if missing:
        raise ConfigError(
            f"otlp_endpoint {settings.otlp_endpoint!r} (from "
            f"{sources.source_of('otlp_endpoint')}) needs the OpenTelemetry SDK and OTLP "
            f"exporters, not installed here ({', '.join(missing)}): pip install "
            f"'{TRACING_EXTRA}' (the container image has them), or leave tracing off"
        )


def check_kv_events(settings: Settings, sources: Sources) -> None:
    """KV-event endpoints stay on the machine unless allowed; the index lives in one process
    and follows one data-parallel rank."""
    endpoint = settings.kv_events_endpoint
    for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
        value = getattr(settings, name)
        if value is None:
            continue
        try:
            check_endpoint(value, allow_remote=settings.kv_events_allow_remote)
        except ValueError as exc:
            raise ConfigError(f"{name} {value!r} (from {sources.source_of(name)}): {exc}") from None
    if endpoint is None:
        for name in ("kv_events_replay_endpoint", "local_prefill_max_uncached_tokens"):
            if getattr(settings, name):
                raise ConfigError(
                    f"{name} (from {sources.source_of(name)}) needs --kv-events-endpoint: the "
                    "local engine's cached blocks are known from its KV events only")
        return
    where = f"kv_events_endpoint (from {sources.source_of('kv_events_endpoint')})"
    if settings.workers > 1:
        raise ConfigError(
            f"{where} needs --workers 1 (from {sources.source_of('workers')}: "
            f"{settings.workers}): one process binds the endpoint and holds the index")
    if settings.data_parallel_size > 1:
        raise ConfigError(
            f"{where} needs --data-parallel-size 1 (from "
            f"{sources.source_of('data_parallel_size')}: {settings.data_parallel_size}): each "
            "rank has its own cache, and the engine chooses a local request's rank")


def data_parallel_warning(settings: Settings, sources: Sources) -> str | None:
    """A warning when data-parallel sizes are set for an engine whose dialect names no rank
    (its engine places requests on its ranks itself), else None."""
    sizes = [name for name in ("data_parallel_size", "prefill_data_parallel_size")
             if (getattr(settings, name) or 1) > 1]
    if not sizes or dialect_class(settings.engine, settings.kv_connector).ranked:
        return None
    given = ", ".join(f"{name} (from {sources.source_of(name)})" for name in sizes)
    return (f"{given} set for engine {settings.engine!r}, which places requests on its "
            "data-parallel ranks itself: the sidecar names no rank")


def empty_allowlist_warning(settings: Settings, sources: Sources) -> str | None:
    """A warning when routers can only name prefill targets (no static pool) and nothing may
    be named: every PD request would be refused with 403 ``prefill_target_not_allowed``."""
    if (settings.role is Role.PREFILL or settings.prefill_allowlist
            or settings.prefill_pod_selector or settings.prefill_urls):
        return None
    return (
        f"the prefill allowlist is empty (--prefill-allowlist, from "
        f"{sources.source_of('prefill_allowlist')}) and no --prefill-pod-selector or "
        "--prefill-url is set: every prefill target a router names in x-prefiller-host-port "
        "is refused (403 prefill_target_not_allowed); allow the prefill engines, e.g. "
        "--prefill-allowlist 10.0.0.0/8:8000, or --role prefill on prefill pods"
    )


def allowlist_name_warnings(settings: Settings, sources: Sources) -> list[str]:
    """A warning for each allowlist entry that names a host: entries match literally (names
    are not resolved at start), so ``localhost:8100`` admits a router naming
    ``localhost:8100`` and refuses one naming ``127.0.0.1:8100`` (403)."""
    warnings = []
    for text in settings.prefill_allowlist:
        entry = parse_entry(text)
        if entry.hostname is None:
            continue
        port = "PORT" if entry.port is None else str(entry.port)
        example = "127.0.0.1" if entry.hostname == "localhost" else "one of its addresses"
        warnings.append(
            f"prefill_allowlist entry {text!r} (from {sources.source_of('prefill_allowlist')}) "
            f"names a host: entries match literally, so it admits a router naming "
            f"{entry.hostname}:{port} and refuses one naming {example}:{port} (403); to admit "
            "an address, list it or its network (names are not resolved)"
        )
    return warnings
