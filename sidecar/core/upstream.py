"""The one pooled HTTP client per process, and the header rules for forwarding.

    settings ─make_session()─▶ aiohttp.ClientSession (pooled, keep-alive < engines' 5 s)

Why these knobs: vLLM closes idle connections after 5 s, so a pool that keeps them longer gets
resets on reuse; no total timeout (it would cut long decode streams), only connect and
per-read deadlines; ``trust_env=False`` so proxy variables never reroute a prompt; redirects
are refused per request (``allow_redirects=False``) by the callers.

Deliberate limits: one session serves every upstream; its connection limit is global.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import aiohttp
from multidict import CIMultiDict

from sidecar.settings import Settings
from sidecar.tls import client_ssl_context

#: Hop-by-hop headers (RFC 9110 section 7.6.1) and those the client library recomputes.
_NOT_FORWARDED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)

#: Routing headers a router sets for the sidecar; never forwarded to an engine.
ROUTING_HEADERS = frozenset({"x-prefiller-host-port", "x-prefiller-url", "x-decoder-host-port"})

REQUEST_ID_HEADER = "X-Request-Id"


def make_session(settings: Settings) -> aiohttp.ClientSession:
    """The process-wide upstream session; create it inside the running event loop."""
    # Without engine_ca_file an https upstream is verified against the system store.
    ssl_context = (
        client_ssl_context(settings.engine_ca_file) if settings.engine_ca_file else True
    )
    connector = aiohttp.TCPConnector(
        limit=settings.max_connections,
        limit_per_host=0,
        keepalive_timeout=settings.keepalive_s,
        ttl_dns_cache=10,
        ssl=ssl_context,
    )
    timeout = aiohttp.ClientTimeout(
        total=None,
        sock_connect=settings.connect_timeout_s,
        sock_read=settings.read_timeout_s,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        # One session serves every client: a cookie an engine sets for one client must not
        # ride along on the next client's requests (and the jar costs work per request).
        cookie_jar=aiohttp.DummyCookieJar(),
        trust_env=False,
        auto_decompress=False,
        skip_auto_headers=("User-Agent",),
    )


def forwardable_headers(
    headers: Iterable[tuple[str, str]] | Mapping[str, str],
    *,
    drop: Iterable[str] = (),
) -> CIMultiDict[str]:
    """Client headers minus hop-by-hop, routing and ``drop`` headers (case-insensitive)."""
    dropped = {name.lower() for name in drop}
    items = headers.items() if isinstance(headers, Mapping) else headers
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in items:
        lower = name.lower()
        if lower in _NOT_FORWARDED or lower in ROUTING_HEADERS or lower in dropped:
            continue
        out.add(name, value)
    return out


def response_headers(headers: Iterable[tuple[str, str]]) -> CIMultiDict[str]:
    """Upstream response headers that may be relayed to the client."""
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers:
        lower = name.lower()
        if lower in _NOT_FORWARDED or (lower == "content-encoding" and value == "identity"):
            continue
        out.add(name, value)
    return out
