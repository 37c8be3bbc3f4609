"""The lean vLLM decode's NIXL pull: ``GET /_stub/nixl/<request id>`` on the hand-off's
``remote_host:remote_port``, over pooled keep-alive connections (``sidecar.http1``).

    Puller.pull(target) ─▶ (status, parsed JSON or None) | None when nothing answered

What the answer means is ``handoff.judge_nixl_pull``'s business, the same for both
transports; this module only carries the bytes, as cheaply as the project's own upstream
client does (one pooled connection per prefill, kept below the lean server's 5 s idle close).

Deliberate limits: plain http, no retry (a failed pull is the verdict ``pull_failed``).
"""

from __future__ import annotations

from typing import Any, Final

import orjson

from sidecar.http1.client import EngineClient
from sidecar.http1.errors import UpstreamError
from sidecar.tools.stubs.handoff import PullTarget

_KEEPALIVE_S: Final = 4.0
_MAX_CONNECTIONS: Final = 256
_MAX_BODY: Final = 1 << 20


class Puller:
    """One decode's client for pulls from its prefills."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._client = EngineClient(
            limit=_MAX_CONNECTIONS,
            keepalive_s=_KEEPALIVE_S,
            connect_timeout_s=timeout_s,
            read_timeout_s=timeout_s,
        )

    async def pull(self, target: PullTarget) -> tuple[int, Any] | None:
        try:
            resp = await self._client.request("GET", target.url, timeout_s=self.timeout_s)
            try:
                body = await resp.read(_MAX_BODY)
            finally:
                resp.release()
        except (UpstreamError, OSError, TimeoutError):
            return None
        try:
            return resp.status, orjson.loads(body) if resp.status == 200 else None
        except orjson.JSONDecodeError:
            return resp.status, None

    async def close(self) -> None:
        await self._client.close()
