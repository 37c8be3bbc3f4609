"""What one upstream request is on the wire: its target, parsed once per URL, and its head.

    target_of(url, server_hostname) ─▶ Target (pool key, address, TLS name, Host header,
                                       request target: path and query)
    encode_head(method, target, headers, framing(method, body, content_length)) ─▶ bytes

URLs are parsed once (cached): the engines' URLs repeat. One whose path carries an id (a new
one per call) would miss that cache every time, and a full parse costs about 6 us: only its
origin's parse is cached then, and its request target is cut off the string (the cut
urlsplit makes; a property test holds the two to the same answer). Header names and values
are checked for line breaks and NUL, so no caller-supplied string can write a header of its
own.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterable, Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from sidecar.http1.errors import UpstreamError
from sidecar.protocol.context import DEFAULT_PORTS, url_port

Headers = Mapping[str, str] | Iterable[tuple[str, str]]
Body = bytes | AsyncIterable[bytes] | None

#: Which pooled connections can serve a request: scheme, host, port and the TLS name the
#: peer's certificate was verified for ("" for plain HTTP).
PoolKey = tuple[str, str, int, str]


@dataclass(frozen=True, slots=True)
class Target:
    """Where a URL's requests go, and what their request line and Host header say."""

    key: PoolKey
    host: str
    port: int
    #: The name the server's certificate must carry; None for plain HTTP.
    tls_name: str | None
    host_header: str
    path: str


@functools.lru_cache(maxsize=4096)
def target_of(url: str, server_hostname: str | None = None) -> Target:
    """Where ``url`` goes and what its request line names (see the module's docstring)."""
    cut = split_origin(url)
    if cut is None:
        return parse_url(url, server_hostname)
    origin, path = cut
    try:
        base = _origin_target(origin, server_hostname)
    except (UpstreamError, ValueError):
        return parse_url(url, server_hostname)  # the error, naming the whole URL
    return Target(base.key, base.host, base.port, base.tls_name, base.host_header, path)


def split_origin(url: str) -> tuple[str, str] | None:
    """``url`` as its ``scheme://authority`` and its request target (path and query, the
    fragment dropped); None when it has no path or holds anything unprintable (urlsplit
    removes tabs and line breaks: the full parse decides those)."""
    start = url.find("://") + 3
    end = url.find("/", start)
    # The authority ends at the first "/", "?" or "#": without a "/" first, parse it whole.
    if start < 4 or end < 0 or url.find("?", start, end) >= 0 or url.find("#", start, end) >= 0:
        return None
    if not url.isprintable():
        return None
    rest = url[end:]
    if "#" in rest:
        rest = rest.partition("#")[0]
    if "?" in rest:
        path, _, query = rest.partition("?")
        rest = f"{path}?{query}" if query else path
    return url[:end], rest


@functools.lru_cache(maxsize=1024)
def _origin_target(origin: str, server_hostname: str | None) -> Target:
    return parse_url(origin, server_hostname)


def parse_url(url: str, server_hostname: str | None) -> Target:
    """The whole parse of ``url`` (urlsplit); UpstreamError when it is no http(s) URL."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS or not parts.hostname:
        raise UpstreamError(f"unsupported upstream URL {url!r}")
    host = parts.hostname
    port = url_port(parts)
    shown = f"[{host}]" if ":" in host else host
    host_header = shown if port == DEFAULT_PORTS[scheme] else f"{shown}:{port}"
    path = parts.path or "/"
    if parts.query:
        path = f"{path}?{parts.query}"
    tls_name = (server_hostname or host) if scheme == "https" else None
    key = (scheme, host, port, tls_name or "")
    return Target(key, host, port, tls_name, host_header, path)


def encode_head(method: str, target: Target, headers: Headers, framing: str) -> bytes:
    """The request line and headers; ``framing`` is the body's length header line (or "")."""
    lines = [f"{name}: {value}\r\n" for name, value in
             (headers.items() if isinstance(headers, Mapping) else headers)]
    block = "".join(lines)
    # Header injection: each line adds exactly one CR and one LF; a CR, LF or NUL inside a
    # name or value would let a caller-supplied string write headers of its own.
    if block.count("\n") != len(lines) or block.count("\r") != len(lines) or "\0" in block:
        raise UpstreamError("header name or value contains a line break or NUL")
    head = (f"{method} {target.path} HTTP/1.1\r\nHost: {target.host_header}\r\n"
            f"{block}{framing}\r\n")
    return head.encode("utf-8", "surrogateescape")


def framing(method: str, body: Body, content_length: int | None) -> str:
    """The body's length header line: its size, chunked for a stream of unknown size, or none."""
    if isinstance(body, bytes):
        return f"Content-Length: {len(body)}\r\n"
    if body is None:
        return "Content-Length: 0\r\n" if method in ("POST", "PUT", "PATCH") else ""
    if content_length is None:
        return "Transfer-Encoding: chunked\r\n"
    return f"Content-Length: {content_length}\r\n"
