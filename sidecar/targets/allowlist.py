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


def parse_entry(text: str) -> AllowEntry:
    """Parse one entry; ValueError with the entry quoted when it is malformed."""
    entry = text.strip()
    if entry.startswith("["):
        inner, sep, rest = entry[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"allowlist entry {text!r}: expected [IPv6]:PORT or [IPv6/N]:*")
        network = _parse_network(inner, text)
        if network.version != 6:
            raise ValueError(f"allowlist entry {text!r}: brackets are for IPv6 only")
        return AllowEntry(entry, None, network, _parse_port(rest[1:], text))
    host, sep, port_text = entry.rpartition(":")
    if not sep or not host:
        raise ValueError(
            f"allowlist entry {text!r}: expected HOST:PORT, HOST:*, CIDR:PORT or CIDR:* "
            "(IPv6 in brackets: [fd00::/8]:*)"
        )
    if ":" in host:
        raise ValueError(f"allowlist entry {text!r}: write IPv6 in brackets, e.g. [fd00::/8]:*")
    port = _parse_port(port_text, text)
    if "/" in host or host.replace(".", "").isdigit():
        return AllowEntry(entry, None, _parse_network(host, text), port)
    return AllowEntry(entry, _check_hostname(host, text), None, port)


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
