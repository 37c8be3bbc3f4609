"""Holding the pool's ports: the supervisor binds each port once, the workers share it.

    reserve(host, port) -> socket   bound with SO_REUSEPORT, never listening

Why the supervisor holds them: docs/design-notes.md#pool-ports
"""

from __future__ import annotations

import socket


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
