"""The lean vLLM decode's NIXL pull: ``GET /_stub/nixl/<request id>`` on the hand-off's
``remote_host:remote_port``, over the project's pooled upstream client (``sidecar.http1``).

    await Puller.pull(target) ─▶ (status, parsed JSON or None)
                                 or None (nothing answered: unreachable, closed, past the timeout)

What the answer means is ``handoff.judge_nixl_pull``'s business, the same for both
transports; this module only carries the bytes. Pooled keep-alive connections per prefill
(``EngineClient``), idle ones dropped after 4 s, below the lean server's 5 s idle close, so a
pull never races that close; the timeout bounds the whole pull, connecting included.

Deliberate limits: plain http, no retry (a failed pull is the verdict ``pull_failed``); an
answer over 1 MiB is no answer.
"""

from __future__ import annotations

from typing import Any, Final

import orjson

from sidecar.http1 import EngineClient, UpstreamError
from sidecar.tools.stubs.handoff import PullTarget

Pulled = tuple[int, Any] | None

_KEEPALIVE_S: Final = 4.0
_MAX_CONNECTIONS: Final = 256
_MAX_BODY: Final = 1 << 20


class Puller:
    """One decode's pulls from its prefills; create it inside the running loop."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._client = EngineClient(
            limit=_MAX_CONNECTIONS,
            keepalive_s=_KEEPALIVE_S,
            connect_timeout_s=timeout_s,
            read_timeout_s=None,  # the pull's own deadline bounds every read
        )

    async def pull(self, target: PullTarget) -> Pulled:
        """Ask ``target`` for its held blocks: its status and parsed body, or None."""
        try:
            response = await self._client.request("GET", target.url, timeout_s=self.timeout_s)
            try:
                body = await response.read(_MAX_BODY)
            finally:
                response.release()
        except (UpstreamError, OSError, TimeoutError):
            return None
        if len(body) > _MAX_BODY:
            return None
        if response.status != 200:
            return response.status, None
        try:
            return response.status, orjson.loads(body)
        except orjson.JSONDecodeError:
            return response.status, None

    async def close(self) -> None:
        await self._client.close()
