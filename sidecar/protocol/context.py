"""What a hand-off is built from: the route, the prefill target, the front door, the legs'
data-parallel ranks, and the dialect's own per-request state.

The PD flow makes one ``HandoffContext`` per request; its dialect fills ``state``
(``Dialect.begin``) and reads it back; nothing else looks inside.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, NamedTuple

from sidecar.protocol.hostfmt import url_host


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


@dataclass(frozen=True, slots=True)
class HandoffContext:
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
        return replace(self, state=state)
