"""Holding the pool's ports: the supervisor binds each port once, the workers share it; and
refusing a port another program holds.

    reserve(host, port) -> socket   bound with SO_REUSEPORT, never listening
    check_free(host, port, flag)    PortInUse when anything else is bound there

Why the supervisor holds them: docs/extending/design-notes.md#pool-ports
"""

from __future__ import annotations

import contextlib
import errno
import socket

from sidecar.protocol.context import url_host


class PortInUse(Exception):
    """A port the sidecar was told to listen on is held by another program (one line)."""


def check_free(host: str, port: int, flag: str) -> None:
    """Raise ``PortInUse`` when ``(host, port)`` is bound by anyone (port 0: never).

    Only the sidecar's own workers may share its ports: servers that set SO_REUSEPORT
    (grpcio does by default) would otherwise let a second sidecar, or anything else, join the
    port silently and take part of its connections. The probe binds without SO_REUSEPORT, so
    any other socket on the port, with or without it, makes it fail.
    """
    if port == 0:
        return
    infos = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    family, kind, proto, _, address = infos[0]
    with contextlib.closing(socket.socket(family, kind, proto)) as probe:
        # SO_REUSEADDR: connections of an earlier run in TIME_WAIT do not count as a holder.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise PortInUse(
                f"{flag} {url_host(host)}:{port} is in use by another program (only this "
                "sidecar's own workers share its ports)"
            ) from None


def reserve(host: str, port: int) -> socket.socket:
    """A socket bound to ``(host, port)`` that workers with SO_REUSEPORT can join."""
    infos = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            # asyncio's servers bind IPv6 sockets v6-only; the reservation must match them.
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def bound_port(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])
