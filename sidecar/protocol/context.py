"""What a hand-off is built from: the route, the prefill target and the per-request ids.

The orchestrator fills a ``HandoffContext`` once per request (ids come from ``sidecar.ids``,
the Mooncake engine id from the prefill's bootstrap ``/query``); engine handlers and KV agents
read it and never do I/O themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import NamedTuple

from sidecar.protocol.hostfmt import url_host


class Route(StrEnum):
    """The OpenAI routes that run as prefill/decode pairs."""

    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


class PrefillTarget(NamedTuple):
    """A prefill engine's address: host (IPv6 without brackets), port and scheme.

    ``scheme`` is ``https`` only for a static pool entry written so (a router's header names
    plain ``host:port``). ``tls_name`` is the name its certificate must carry when ``host``
    is the address that name resolved to (the sidecar connects to the address it resolved,
    and the hand-off names that address); None: verify ``host`` itself.

    A named tuple, not a dataclass: targets key the per-request lookups (in-flight legs,
    remembered URLs), and a tuple hashes in C.
    """

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


@dataclass(frozen=True, slots=True)
class HandoffContext:
    """Everything a handler or agent needs besides the bodies.

    ``advertise_host`` is the address the *decode* engine must use to reach the prefill
    engine's KV side channel (NIXL ``remote_host``, Mooncake bootstrap host). Over HTTP it is
    the prefill target's host; over gRPC the prefill sidecar fills in its own pod address.
    """

    route: Route
    request_id: str
    prefill: PrefillTarget
    advertise_host: str
    sglang_bootstrap_port: int = 8998
    sglang_room: int | None = None
    trtllm_disagg_request_id: int | None = None
    mooncake_bootstrap_port: int = 8998
    mooncake_transfer_id: str | None = None
    mooncake_engine_id: str | None = None
    #: Inline KV transport: the staging key of this request's KV (``sidecar.kv_agents.inline``).
    inline_key: str | None = None

    def with_ids(self, **ids: object) -> HandoffContext:
        """A copy with some per-request ids set."""
        return replace(self, **ids)  # type: ignore[arg-type]
