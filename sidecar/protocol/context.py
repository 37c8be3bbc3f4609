"""What a hand-off is built from: the route, the prefill target, the front door, the legs'
data-parallel ranks, and the dialect's own per-request state; and how hosts are written.

The runner makes one ``HandoffContext`` per request; its dialect fills ``state``
(``Dialect.begin``) and reads it back; nothing else looks inside.

Hosts: an IPv6 literal goes in brackets inside a URL or ``host:port``
(``http://[fd00::1]:8998``), anything else as is; ``localhost`` and loopback addresses are
what other pods cannot reach; a URL without a port has its scheme's (``url_port``: the one
copy of the schemes' default ports). No DNS resolution and no validation of names here; an
already bracketed host is left alone (idempotent).
"""

from __future__ import annotations

import ipaddress
from enum import StrEnum
from typing import Any, Final, NamedTuple
from urllib.parse import SplitResult

import msgspec


class Route(StrEnum):
    """The HTTP routes that may run as prefill/decode pairs (each API's rules:
    ``sidecar.protocol.apis``; which ones an engine runs so: ``Dialect.pd_routes``)."""

    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    #: The OpenAI Responses API.
    RESPONSES = "/v1/responses"
    #: The Anthropic Messages API.
    MESSAGES = "/v1/messages"
    #: Token ids in, token ids out (an engine serves it only when started to).
    GENERATE = "/inference/v1/generate"


#: The two OpenAI routes every engine serves (and the only ones that fan out).
OPENAI_ROUTES: frozenset[Route] = frozenset({Route.COMPLETIONS, Route.CHAT})


class PrefillTarget(NamedTuple):
    """A prefill engine's address: host (IPv6 without brackets), port and scheme (``https``
    only for a static pool entry written so; a router's header names plain ``host:port``);
    ``tls_name``: the name its certificate must carry when ``host`` is the address that name
    resolved to (None: verify ``host``). A named tuple: targets key the per-request lookups
    (in-flight legs, remembered URLs), and a tuple hashes in C."""

    host: str
    port: int
    scheme: str = "http"
    tls_name: str | None = None

    @property
    def url_host(self) -> str:
        """The host as written in a URL (IPv6 in brackets)."""
        return url_host(self.host)

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://{self.url_host}:{self.port}"

    def __str__(self) -> str:
        return f"{self.url_host}:{self.port}"


class FrontDoor(StrEnum):
    """The front door a request came in by."""

    HTTP = "http"
    GRPC = "grpc"


class HandoffContext(msgspec.Struct, frozen=True):
    """What every request has besides its bodies, and its dialect's own state.

    ``advertise_host`` is the address the *decode* engine must use to reach the prefill
    engine's side channel. Over HTTP it is the prefill target's host; over gRPC the prefill
    sidecar fills in its own pod address. ``state`` belongs to the dialect that set it
    (``Dialect.begin``); nothing else reads it.

    ``prefill_rank`` and ``decode_rank`` are the data-parallel ranks the legs run on, chosen
    by the flow (``sidecar.targets.choice``); None where the engine has one rank (or, over
    gRPC, where the other sidecar chooses: a Prefill knows no decode rank).
    """

    route: Route
    request_id: str
    prefill: PrefillTarget
    advertise_host: str
    front_door: FrontDoor = FrontDoor.HTTP
    state: Any = None
    prefill_rank: int | None = None
    decode_rank: int | None = None

    def with_state(self, state: object) -> HandoffContext:
        """A copy holding the dialect's ``state``."""
        return msgspec.structs.replace(self, state=state)


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
