"""The TLS settings: the sidecar's own certificate, its clients' CA, and its engines' trust.

Part of ``sidecar.config.settings.Settings``; pairs whole, files loading: ``checks.check_tls``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TLSSettings(BaseModel):
    """TLS in (HTTPS and gRPC TLS, mutual TLS) and out (https engines and prefill targets)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tls_cert_file: str | None = Field(
        default=None,
        description="PEM certificate chain: with --tls-key-file, serve HTTPS on the HTTP port "
        "and TLS on the gRPC port (the metrics port stays plaintext). Reloaded when it changes.",
    )
    tls_key_file: str | None = Field(
        default=None,
        description="PEM private key of --tls-cert-file; set both or neither.",
    )
    tls_reload_interval_s: float = Field(
        default=10.0,
        gt=0,
        description="How often the TLS files are checked for a new certificate, seconds.",
    )
    tls_client_ca_file: str | None = Field(
        default=None,
        description="Mutual TLS: PEM CA bundle; with --tls-cert-file, the HTTP and gRPC ports "
        "require a client certificate it signed (the metrics port does not). Reloaded when "
        "it changes.",
    )
    engine_ca_file: str | None = Field(
        default=None,
        description="PEM CA bundle that verifies https engines and prefill targets; unset: "
        "the system store. Verification is never turned off.",
    )
    engine_client_cert_file: str | None = Field(
        default=None,
        description="Mutual TLS to engines: PEM client certificate chain presented to https "
        "engines and prefill targets; with --engine-client-key-file, both or neither. Read at "
        "start.",
    )
    engine_client_key_file: str | None = Field(
        default=None,
        description="PEM private key of --engine-client-cert-file.",
    )
