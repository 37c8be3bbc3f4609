"""Host formatting and classification: an IPv6 literal goes in brackets inside a URL or
``host:port`` (``http://[fd00::1]:8998``), anything else as is; ``localhost`` and loopback
addresses are what other pods cannot reach; a URL without a port has its scheme's
(``url_port``: the one copy of the schemes' default ports).

Deliberate limits: no DNS resolution and no validation of names; an already bracketed host
is left alone (idempotent).
"""

from __future__ import annotations

import ipaddress
from typing import Final
from urllib.parse import SplitResult

#: The port a URL of each scheme means when it names none.
DEFAULT_PORTS: Final = {"http": 80, "https": 443}


def url_port(parts: SplitResult) -> int:
    """The port a split URL names, else its scheme's default (80 for an unknown scheme)."""
    return parts.port or DEFAULT_PORTS.get(parts.scheme.lower(), 80)


def is_ipv6_literal(host: str) -> bool:
    """True when ``host`` is a bare IPv6 address (a zone suffix such as ``%eth0`` allowed)."""
    if ":" not in host:
        return False  # every IPv6 literal has a colon; names and IPv4 never do (hot path)
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


def url_host(host: str) -> str:
    """``host`` as written before ``:port`` in a URL: IPv6 literals in brackets."""
    return f"[{host}]" if is_ipv6_literal(host) else host


def http_url(host: str, port: int) -> str:
    """``http://<host>:<port>`` with IPv6 literals bracketed."""
    return f"http://{url_host(host)}:{port}"


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
