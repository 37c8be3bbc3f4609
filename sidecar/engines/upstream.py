"""The one pooled HTTP client per process, and the header rules for forwarding.

    settings ─make_session()─▶ EngineClient (pooled, keep-alive < engines' 5 s)

Deliberate limits: one session serves every upstream; its connection limit is global.
Why these knobs: docs/extending/design-notes.md#upstream-client
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from multidict import CIMultiDict

from sidecar.config.settings import Settings
from sidecar.http1 import EngineClient
from sidecar.targets.ranks import RANK_HEADER
from sidecar.targets.selector import PREFILL_TARGET_HEADER
from sidecar.tls import client_ssl_context

#: Hop-by-hop headers (RFC 9110 section 7.6.1) and those the client library recomputes.
_NOT_FORWARDED = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length",
})

#: Routing headers a router sets for the sidecar (the prefill target, the data-parallel rank,
#: and the other pods of a request: llm-d's and AIBrix's names); never forwarded to an engine,
#: on any path (a decode leg's rank is the dialect's to set, where its engine reads it).
ROUTING_HEADERS = frozenset({
    PREFILL_TARGET_HEADER, "x-prefiller-url", "x-decoder-host-port", "x-encoder-hosts-ports",
    RANK_HEADER,
})

#: Request headers that describe bytes the engine never gets: a body reaches an engine plain
#: (aiohttp decoded it, or the front door refused it: ``http_server.body_encoding``).
_REQUEST_ONLY_DROPPED = frozenset({"content-encoding"})


def make_session(settings: Settings) -> EngineClient:
    """The process-wide upstream client; create it inside the running event loop."""
    # No engine_ca_file nor client certificate: the system store, loaded at the first https.
    ssl_context = (
        client_ssl_context(settings.engine_ca_file, settings.engine_client_cert_file,
                           settings.engine_client_key_file)
        if settings.engine_ca_file or settings.engine_client_cert_file else None
    )
    return EngineClient(limit=settings.max_connections, keepalive_s=settings.keepalive_s,
                        connect_timeout_s=settings.connect_timeout_s,
                        read_timeout_s=settings.read_timeout_s, ssl_context=ssl_context)


def _connection_options(value: str) -> list[str]:
    """The header names one ``Connection`` header lists (RFC 9110 7.6.1: hop-by-hop too)."""
    return [token.strip().lower() for token in value.split(",")]


def _without(out: CIMultiDict[str], names: Iterable[str]) -> CIMultiDict[str]:
    for name in names:
        out.popall(name, None)
    return out


def forwardable_headers(headers: Iterable[tuple[str, str]] | Mapping[str, str], *,
                        drop: Iterable[str] = ()) -> CIMultiDict[str]:
    """Client headers minus hop-by-hop (those ``Connection`` names among them), routing,
    ``Content-Encoding`` and ``drop`` headers (case-insensitive)."""
    dropped = {name.lower() for name in drop}
    items = headers.items() if isinstance(headers, Mapping) else headers
    out: CIMultiDict[str] = CIMultiDict()
    named: list[str] = []
    for name, value in items:
        lower = name.lower()
        if lower == "connection":
            named += _connection_options(value)
        elif not (lower in _NOT_FORWARDED or lower in ROUTING_HEADERS or lower in dropped
                  or lower in _REQUEST_ONLY_DROPPED):
            out.add(name, value)
    return _without(out, named) if named else out


def with_headers(headers: Mapping[str, str], extra: Mapping[str, str]) -> Mapping[str, str]:
    """``headers`` with ``extra`` set over them (case-insensitive); ``headers`` itself when
    ``extra`` is empty (a leg without them takes the very headers it took before)."""
    if not extra:
        return headers
    out: CIMultiDict[str] = CIMultiDict(headers)
    for name, value in extra.items():
        out[name] = value
    return out


def response_headers(headers: Iterable[tuple[str, str]]) -> CIMultiDict[str]:
    """Upstream response headers that may be relayed to the client (hop-by-hop ones, and
    those the engine's ``Connection`` names, left out)."""
    out: CIMultiDict[str] = CIMultiDict()
    named: list[str] = []
    for name, value in headers:
        lower = name.lower()
        if lower == "connection":
            named += _connection_options(value)
        elif not (lower in _NOT_FORWARDED
                  or (lower == "content-encoding" and value == "identity")):
            out.add(name, value)
    return _without(out, named) if named else out
