"""Mooncake engine ids from the prefill's bootstrap server, looked up once per host.

The decode body of the Mooncake flow names the prefill engine (``remote_engine_id``), which
only the prefill's bootstrap ``GET /query`` tells. Ids change when an engine restarts, so
entries expire after ``ttl_s`` (a minute): a restarted prefill engine is asked again then.

Deliberate limits: no invalidation on a failed decode: a decode can fail for many reasons, and
the engine id it used is stale only after a restart, which the expiry covers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from sidecar import jsonutil
from sidecar.errors import InvalidHandoff, Stage
from sidecar.http1 import EngineClient, UpstreamError

#: A bootstrap /query answer is a small JSON object.
_MAX_QUERY_BYTES = 1024 * 1024


class EngineIdCache:
    """Caches ``host:port -> engine id`` for ``ttl_s`` seconds."""

    def __init__(
        self,
        session: EngineClient,
        parse: Callable[[object], str],
        *,
        ttl_s: float = 60.0,
        timeout_s: float = 5.0,
    ) -> None:
        self._session = session
        self._parse = parse
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s
        self._entries: dict[str, tuple[float, str]] = {}

    async def get(self, url_host: str, port: int) -> str:
        key = f"{url_host}:{port}"
        entry = self._entries.get(key)
        now = time.monotonic()
        if entry is not None and entry[0] > now:
            return entry[1]
        engine_id = await self._query(f"http://{key}/query")
        self._entries[key] = (now + self._ttl_s, engine_id)
        return engine_id

    async def _query(self, url: str) -> str:
        try:
            async with asyncio.timeout(self._timeout_s):
                async with await self._session.get(url) as response:
                    if response.status != 200:
                        raise InvalidHandoff(
                            f"prefill bootstrap /query answered HTTP {response.status}",
                            stage=Stage.PREFILL,
                        )
                    raw = await response.read(_MAX_QUERY_BYTES)
        except (UpstreamError, TimeoutError):
            raise InvalidHandoff(
                "prefill bootstrap /query unreachable", stage=Stage.PREFILL
            ) from None
        try:
            payload = jsonutil.loads(raw)
        except jsonutil.JSONDecodeError:
            raise InvalidHandoff("prefill bootstrap /query answered malformed JSON") from None
        return self._parse(payload)
