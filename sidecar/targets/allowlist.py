"""The prefill-target allowlist: which ``host:port`` a router may send a prompt to.

Entries, each naming a port or ``*`` (any port) so an IP rule never opens every port:

    prefill.ns.svc:8000     a host name (case-insensitive, trailing dot ignored)
    prefill.ns.svc:*
    10.0.0.7:8000           a bare IP is a /32 (IPv4) or /128 (IPv6)
    10.0.0.0/8:*            a network
    [fd00::/8]:8000         IPv6 addresses and networks in brackets

``Allowlist.allows(host, addresses, port)`` passes a target when its host name is covered,
or when EVERY address it resolved to is covered, for that port. No I/O here: the caller
resolves once, checks, and connects only to the addresses it checked (no DNS rebinding).

Deliberate limits: no wildcard host names (``*:8000``, ``*.svc``: the open-proxy hole the
allowlist closes; write ``0.0.0.0/0:8000`` if that is meant); an empty allowlist allows
nothing (the caller allows the static prefill pool).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


@dataclass(frozen=True)
class AllowEntry:
    """One parsed entry: a host name or a network, and a port (None: any port)."""

    text: str
    hostname: str | None
    network: IPNetwork | None
    port: int | None

    def covers_port(self, port: int) -> bool:
        return self.port is None or self.port == port


def _normalize_hostname(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    # "a.b." and "a.b" are the same fully qualified name.
    return host[:-1] if host.endswith(".") else host


def _parse_port(text: str, entry: str) -> int | None:
    if text == "*":
        return None
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"allowlist entry {entry!r}: port must be 1..65535 or '*'")
    return int(text)


def _parse_network(text: str, entry: str) -> IPNetwork:
    try:
        return ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        raise ValueError(f"allowlist entry {entry!r}: {exc}") from None


def _check_hostname(host: str, entry: str) -> str:
    name = _normalize_hostname(host)
    if "*" in name:
        raise ValueError(
            f"allowlist entry {entry!r}: wildcard hosts are not supported; "
            "name the hosts or a network (e.g. 10.0.0.0/8:8000)"
        )
    labels = name.split(".")
    if not name or len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise ValueError(f"allowlist entry {entry!r}: {host!r} is not a host name or IP")
    if labels[-1].isdigit():
        # All-numeric last label: a mistyped IP address (e.g. 10.0.0.256), not a name.
        raise ValueError(f"allowlist entry {entry!r}: {host!r} is not a valid IP address")
    return name


def _refuse_url_parts(entry: str, text: str) -> None:
    """An entry written as a URL or with a URL's parts: each form its own message, naming the
    entry as it should be written."""
    if not entry:
        raise ValueError(f"allowlist entry {text!r} is empty: remove the extra comma")
    scheme, sep, rest = entry.partition("://")
    if sep:
        hint = rest.split("/", 1)[0].rpartition("@")[2]
        raise ValueError(
            f"allowlist entry {text!r}: no scheme ({scheme}://): the allowlist names hosts "
            f"and ports, e.g. {hint or 'HOST:PORT'}"
        )
    if "@" in entry:
        raise ValueError(
            f"allowlist entry {text!r}: no user info (before '@'): write "
            f"{entry.rpartition('@')[2]}"
        )
    head, slash, tail = entry.partition("/")
    if slash and not entry.startswith("[") and ":" in head and not head.endswith(":"):
        # HOST:PORT/PATH: a network's prefix length comes before the port (10.0.0.0/8:*).
        raise ValueError(
            f"allowlist entry {text!r}: no path (/{tail}): write {head}; a network is "
            "CIDR:PORT, e.g. 10.0.0.0/8:8000"
        )
    for mark, name in (("?", "query"), ("#", "fragment")):
        if mark in entry:
            raise ValueError(f"allowlist entry {text!r}: no {name} ('{mark}...')")
    if any(ch.isspace() or not ch.isprintable() for ch in entry):
        raise ValueError(f"allowlist entry {text!r}: spaces or control characters")


def parse_entry(text: str) -> AllowEntry:
    """Parse one entry; ValueError with the entry quoted when it is malformed, each malformed
    form with its own message (a URL, user info, a path, a missing port, IPv6 without
    brackets, ...)."""
    entry = text.strip()
    _refuse_url_parts(entry, text)
    if entry.startswith("["):
        inner, sep, rest = entry[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"allowlist entry {text!r}: expected [IPv6]:PORT or [IPv6/N]:*")
        network = _parse_network(inner, text)
        if network.version != 6:
            raise ValueError(f"allowlist entry {text!r}: brackets are for IPv6 only")
        return AllowEntry(entry, None, network, _parse_port(rest[1:], text))
    host, sep, port_text = entry.rpartition(":")
    if not sep:
        raise ValueError(
            f"allowlist entry {text!r} names no port: expected HOST:PORT, HOST:*, CIDR:PORT "
            f"or CIDR:* (e.g. {entry}:8000, or {entry}:* for any port; IPv6 in brackets: "
            "[fd00::/8]:*)"
        )
    if not host:
        raise ValueError(
            f"allowlist entry {text!r} names no host: expected HOST:PORT, HOST:*, CIDR:PORT "
            "or CIDR:* (IPv6 in brackets: [fd00::/8]:*)"
        )
    if ":" in host:
        if _is_ipv6(host):
            raise ValueError(
                f"allowlist entry {text!r}: write IPv6 in brackets, e.g. [{host}]:{port_text}"
            )
        if _is_ipv6(entry):
            raise ValueError(
                f"allowlist entry {text!r} names no port: write [{entry}]:PORT or [{entry}]:*"
            )
        raise ValueError(
            f"allowlist entry {text!r}: one colon, before the port (HOST:PORT); IPv6 in "
            "brackets: [fd00::1]:8000"
        )
    port = _parse_port(port_text, text)
    if "/" in host or host.replace(".", "").isdigit():
        return AllowEntry(entry, None, _parse_network(host, text), port)
    return AllowEntry(entry, _check_hostname(host, text), None, port)


def _is_ipv6(text: str) -> bool:
    try:
        return ipaddress.ip_network(text, strict=False).version == 6
    except ValueError:
        return False


def _forms(address: IPAddress) -> tuple[IPAddress, ...]:
    # ::ffff:a.b.c.d reaches the IPv4 host a.b.c.d, so an IPv4 entry covers it too.
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return (address, address.ipv4_mapped)
    return (address,)


def _covered(address: IPAddress, networks: Sequence[IPNetwork]) -> bool:
    return any(
        form.version == net.version and form in net for form in _forms(address) for net in networks
    )


class Allowlist:
    """A parsed allowlist; immutable."""

    def __init__(self, entries: Iterable[AllowEntry] = ()) -> None:
        self._entries = tuple(entries)

    @classmethod
    def parse(cls, texts: Iterable[str]) -> Allowlist:
        """Parse every entry; the first malformed one raises ValueError."""
        return cls(parse_entry(text) for text in texts)

    def __len__(self) -> int:
        return len(self._entries)

    def allows(self, host: str, addresses: Sequence[IPAddress], port: int) -> bool:
        """Whether ``host:port``, resolved to ``addresses``, is an allowed prefill target."""
        name = _normalize_hostname(host)
        for entry in self._entries:
            if entry.hostname is not None and entry.hostname == name and entry.covers_port(port):
                return True
        if not addresses:
            return False
        networks = [e.network for e in self._entries if e.network and e.covers_port(port)]
        return all(_covered(address, networks) for address in addresses)
