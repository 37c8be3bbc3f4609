"""Where the sidecar hears the engine's KV events, and which side of the socket it takes.

    check_endpoint(url, allow_remote)  the url, or ValueError saying what is accepted
    sidecar_binds(url)                 True: the sidecar binds and the publisher connects

The events carry prompt token ids, so by default only endpoints that stay on the machine are
accepted: ``tcp://`` with a loopback IP literal (``127.0.0.1``, ``[::1]``) and ``ipc://`` paths.
Any other TCP address needs the explicit opt-in (``allow_remote``). ``tcp://*`` (every
interface) is never accepted: the sidecar cannot connect to it, and it would make the engine
listen on every interface.

The sides follow the publisher's rule, the same in vLLM and SGLang: it binds wildcard, IPv6
(``::``) and ``ipc://`` endpoints and connects to every other; the sidecar takes the other
side. So with ``tcp://127.0.0.1:5557`` the sidecar binds (and must be up for the engine's
first batches to arrive), with ``ipc://`` or ``tcp://[::1]`` the engine binds and the sidecar
connects. A replay endpoint is always bound by the engine: the sidecar connects to it.

Deliberate limits: host names (``localhost``) are refused: a bind needs an address, and a name
could resolve off the machine.
"""

from __future__ import annotations

import ipaddress
from typing import Final

TCP: Final = "tcp://"
IPC: Final = "ipc://"


def _tcp_host_port(url: str) -> tuple[str, int]:
    rest = url[len(TCP):]
    host, sep, port_text = rest.rpartition(":")
    if not sep or not port_text.isascii() or not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError("a tcp endpoint is tcp://IP:PORT (IPv6 in brackets)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port_text)


def is_ipv6(url: str) -> bool:
    """True for a ``tcp://[IPv6]:PORT`` endpoint (the socket needs IPv6 turned on)."""
    return url.startswith(TCP) and url[len(TCP):].startswith("[")


def check_endpoint(url: str, *, allow_remote: bool) -> str:
    """``url`` when accepted; ValueError naming what is accepted otherwise."""
    url = url.strip()
    if url.startswith(IPC):
        if len(url) == len(IPC):
            raise ValueError("an ipc endpoint needs a path: ipc:///PATH")
        return url
    if not url.startswith(TCP):
        raise ValueError("the endpoint is tcp://IP:PORT or ipc://PATH")
    host, _ = _tcp_host_port(url)
    if host == "*":
        raise ValueError("a wildcard address cannot be connected to; give a loopback address "
                         "such as tcp://127.0.0.1:5557")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{host!r} is not an IP address (host names are not accepted)") from None
    if not address.is_loopback and not allow_remote:
        raise ValueError(f"{host} is not a loopback address: the events carry prompt token "
                         "ids; to accept it, set --kv-events-allow-remote")
    return url


def sidecar_binds(url: str) -> bool:
    """Whether the sidecar binds ``url`` (the publisher connects to it) or connects."""
    publisher_binds = "*" in url or "::" in url or url.startswith((IPC, "inproc://"))
    return not publisher_binds
