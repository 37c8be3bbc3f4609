"""Prefill targets: strict parsing of ``x-prefiller-host-port``, the static pool, the allowlist.

    header "10.0.0.7:8000" ─parse_target_header()─▶ [PrefillTarget]
        ─TargetSelector.candidates()─▶ resolve once ─▶ every address allowed? ─▶
        (PrefillTarget(ip), ...): the placement picks one (``sidecar.request.placement``)
    pool "https://prefill-0.svc:8443" ─parse_prefill_url()─▶ resolve ─▶
        PrefillTarget(ip, scheme https, tls_name "prefill-0.svc")

The sidecar connects to the address it checked (never re-resolves), so DNS rebinding between
check and connect cannot redirect a prompt. Headers that name IP literals only are checked
once and remembered (the allowlist is immutable and no name is resolved, so the verdict
cannot change); names are resolved and checked on every request. Targets from the static
pool (``--prefill-url``) are trusted configuration and skip the allowlist; an ``https`` entry
stays https (verified against its configured name), a router's header is always plain http.

``candidates()`` gives the whole checked list: of several targets (a header list, or the
static pool) the placement picks one (``TargetChoice``: the fewest prefill legs in flight,
skipping targets whose connect was just refused or whose circuit breaker is open), and a
prefill that did no work can move to another. A resolved pool member is labelled by its
address (``TargetChoice.add_pool_member``).

Deliberate limits: one address per target is used (the first resolved); targets are checked
for health only while their circuit breaker is open (``sidecar.engines.health``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Sequence
from typing import Protocol
from urllib.parse import urlsplit

from sidecar.bounded import BoundedMap
from sidecar.errors import InvalidRequest, PrefillFailed, TargetNotAllowed
from sidecar.protocol.context import PrefillTarget
from sidecar.targets.choice import TargetChoice

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

PREFILL_TARGET_HEADER = "x-prefiller-host-port"

# Whole-string patterns (``fullmatch``): ``$`` would also match before a final line feed.
_HOSTNAME = re.compile(r"(?=.{1,253}\Z)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")
_PORT = re.compile(r"[0-9]{1,5}")
_MAX_TARGETS = 16
#: Checked literal-address selections kept (the oldest remembered out first: read with
#: ``peek``, at a dict's speed, on every request).
_MAX_REMEMBERED = 1024


class AllowlistLike(Protocol):
    def allows(self, host: str, addresses: Sequence[IPAddress], port: int) -> bool: ...


def parse_host_port(text: str) -> PrefillTarget:
    """One ``host:port`` (IPv6 in brackets); refuses schemes, user info, paths and controls."""
    if not text or any(ord(ch) < 0x21 or ord(ch) == 0x7F for ch in text):
        raise InvalidRequest("x-prefiller-host-port: empty value or control/space characters")
    if text.startswith("["):
        close = text.find("]")
        if close < 0 or text[close + 1 : close + 2] != ":":
            raise InvalidRequest("x-prefiller-host-port: IPv6 host needs the form [addr]:port")
        host, port_text = text[1:close], text[close + 2 :]
        try:
            if ipaddress.ip_address(host).version != 6:
                raise ValueError(host)
        except ValueError:
            raise InvalidRequest("x-prefiller-host-port: malformed IPv6 address") from None
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not _HOSTNAME.fullmatch(host):
            raise InvalidRequest(
                "x-prefiller-host-port: expected HOST:PORT with no scheme, user info or path"
            )
        host = host.rstrip(".").lower()
    if not _PORT.fullmatch(port_text) or not 1 <= int(port_text) <= 65535:
        raise InvalidRequest("x-prefiller-host-port: port must be 1..65535")
    return PrefillTarget(host=host, port=int(port_text))


def parse_target_header(values: Sequence[str]) -> list[PrefillTarget]:
    """All targets named by (possibly repeated, comma-separated) header values."""
    targets = [
        parse_host_port(item.strip())
        for value in values
        for item in value.split(",")
        if item.strip()
    ]
    if not targets:
        raise InvalidRequest("x-prefiller-host-port: no target given")
    if len(targets) > _MAX_TARGETS:
        raise InvalidRequest("x-prefiller-host-port: too many targets")
    return targets


def parse_prefill_url(url: str) -> PrefillTarget:
    """A static pool entry ``http(s)://host:port`` (its shape checked by the settings); the
    scheme is kept: an ``https`` entry is dialled over TLS and verified, never downgraded."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or parts.hostname is None or parts.port is None:
        raise ValueError(f"prefill URL {url!r} needs http(s)://host:port")
    return PrefillTarget(host=parts.hostname, port=parts.port, scheme=scheme)


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


class TargetSelector:
    """Picks the prefill target of a request and checks it against the allowlist."""

    def __init__(
        self,
        allowlist: AllowlistLike,
        pool: Sequence[PrefillTarget],
        *,
        resolve_timeout_s: float,
        choice: TargetChoice | None = None,
    ) -> None:
        self._allowlist = allowlist
        self._pool = list(pool)
        self._resolved_pool: tuple[PrefillTarget, ...] | None = None
        self.choice = choice if choice is not None else TargetChoice(cooldown_s=0.0)
        self._resolve_timeout_s = resolve_timeout_s
        # A header of IP literals only (no DNS: nothing to rebind) checks the same every time:
        # remembered by the header's values (a router's input: bounded).
        self._literal_selections: BoundedMap[tuple[str, ...], tuple[PrefillTarget, ...]] = (
            BoundedMap(_MAX_REMEMBERED))
        self._allowlist_version: object = getattr(allowlist, "version", 0)

    async def candidates(self, header_values: Sequence[str]) -> tuple[PrefillTarget, ...]:
        """Every checked target a request may use (the header's, else the pool's; may be
        empty): a prefill whose connect is refused moves to another (``Runner.start``)."""
        if header_values:
            # A live allowlist (Kubernetes mode) bumps ``version``: remembered verdicts go.
            version = getattr(self._allowlist, "version", 0)
            if version != self._allowlist_version:
                self._literal_selections.clear()
                self._allowlist_version = version
            key = tuple(header_values)
            checked = self._literal_selections.peek(key)
            if checked is None:
                targets = parse_target_header(header_values)
                checked = tuple([await self._check(target) for target in targets])
                if all(_literal(target.host) is not None for target in targets):
                    self._literal_selections[key] = checked
            return checked
        if self._resolved_pool is not None:
            return self._resolved_pool
        if self._pool:
            resolved = tuple([await self._pool_member(target) for target in self._pool])
            if all(_literal(target.host) is not None for target in self._pool):
                self._resolved_pool = resolved  # literals resolve the same way every time
            return resolved
        return ()

    async def _pool_member(self, target: PrefillTarget) -> PrefillTarget:
        addresses = await self._resolve(target)
        # Over TLS the certificate names the configured host (an IP literal verifies itself).
        tls_name = (target.host if target.scheme == "https" and _literal(target.host) is None
                    else None)
        member = PrefillTarget(str(addresses[0]), target.port, target.scheme, tls_name)
        self.choice.add_pool_member(member)
        return member

    async def _check(self, target: PrefillTarget) -> PrefillTarget:
        literal = _literal(target.host)
        addresses = [literal] if literal is not None else await self._resolve(target)
        if not self._allowlist.allows(target.host, addresses, target.port):
            raise TargetNotAllowed(f"prefill target {target} is not on the allowlist")
        return PrefillTarget(host=str(addresses[0]), port=target.port)

    async def _resolve(self, target: PrefillTarget) -> list[IPAddress]:
        literal = _literal(target.host)
        if literal is not None:
            return [literal]
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._resolve_timeout_s):
                infos = await loop.getaddrinfo(
                    target.host, target.port, type=socket.SOCK_STREAM
                )
        except (OSError, TimeoutError):
            raise PrefillFailed(f"prefill host {target.host} does not resolve") from None
        addresses: list[IPAddress] = []
        for info in infos:
            address = ipaddress.ip_address(info[4][0])
            if address not in addresses:
                addresses.append(address)
        if not addresses:
            raise PrefillFailed(f"prefill host {target.host} does not resolve")
        return addresses
