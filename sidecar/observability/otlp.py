"""Tracing's export: the OTLP endpoint, its exporter, and the SDK provider that runs it.

    settings.otlp_endpoint ──start_tracing()──▶ Tracing (``sidecar.observability.tracing``)
         (unset) ──────────────────────────────▶ NO_TRACING: no SDK import, no thread

The endpoint's scheme picks the transport (OTLP/HTTP is protobuf), and the SDK reads the
standard ``OTEL_*`` variables over this module's defaults (docs/operating/tracing.md; also
``OTEL_EXPORTER_OTLP_COMPRESSION``).

The SDK and the exporters are the ``tracing`` extra (``pip install
'disagg-sidecar[tracing]'``; the container image has it): a sidecar without tracing needs
only the API. ``missing_modules(endpoint)`` names what an endpoint needs and is not installed
(the configuration refuses such an endpoint at start-up).

Deliberate limits: the provider is this process's own, not the OpenTelemetry global one.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Final
from urllib.parse import urlsplit

from sidecar.observability.tracing import NO_TRACING, SERVICE_NAME, NoTracing, Tracing

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

GRPC_SCHEMES: Final = ("grpc", "grpcs")
HTTP_SCHEMES: Final = ("http", "https")
_DEFAULT_HTTP_PATH: Final = "/v1/traces"


def check_endpoint(url: str) -> str:
    """``url`` if it is an OTLP endpoint this module can export to, else ValueError."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"OTLP endpoint {url!r}: {exc}") from None
    if parts.scheme not in GRPC_SCHEMES + HTTP_SCHEMES or not parts.hostname:
        raise ValueError(
            f"OTLP endpoint {url!r} must be grpc://, grpcs://, http:// or https://HOST[:PORT]"
        )
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"OTLP endpoint {url!r} must not carry a query, fragment or credentials")
    if parts.scheme in GRPC_SCHEMES and (port is None or parts.path not in ("", "/")):
        raise ValueError(f"OTLP/gRPC endpoint {url!r} must be {parts.scheme}://HOST:PORT")
    return url


#: The distributions of the ``tracing`` extra, by the module each provides.
_SDK_MODULE: Final = "opentelemetry.sdk"
_EXPORTER_MODULES: Final = {
    "grpc": "opentelemetry.exporter.otlp.proto.grpc",
    "http": "opentelemetry.exporter.otlp.proto.http",
}
TRACING_EXTRA: Final = "disagg-sidecar[tracing]"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent missing, or a module without a spec
        return False


def missing_modules(url: str) -> list[str]:
    """The modules exporting to ``url`` needs that are not installed (found, not imported:
    a sidecar that only checks its configuration loads no SDK)."""
    transport = "grpc" if urlsplit(url).scheme in GRPC_SCHEMES else "http"
    return [module for module in (_SDK_MODULE, _EXPORTER_MODULES[transport])
            if not _installed(module)]


def make_exporter(url: str) -> SpanExporter:
    """The OTLP span exporter the endpoint's scheme names (see the module docstring)."""
    check_endpoint(url)
    parts = urlsplit(url)
    if parts.scheme in GRPC_SCHEMES:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=parts.netloc, insecure=parts.scheme == "grpc")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    path = parts.path if parts.path not in ("", "/") else _DEFAULT_HTTP_PATH
    return HttpExporter(endpoint=f"{parts.scheme}://{parts.netloc}{path}")


def start_tracing(endpoint: str | None) -> Tracing | NoTracing:
    """Tracing exported to ``endpoint``: ``NO_TRACING`` without one (nothing started)."""
    if endpoint is None:
        return NO_TRACING
    # Imported here: a sidecar without tracing never loads the SDK or starts its thread.
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from sidecar import __version__

    # Our defaults first, then OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES over them.
    resource = Resource.create(
        {"service.name": SERVICE_NAME, "service.version": __version__}
    ).merge(OTELResourceDetector().detect())
    # sampler=None: the SDK reads OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG.
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(make_exporter(endpoint)))
    return Tracing(provider)
