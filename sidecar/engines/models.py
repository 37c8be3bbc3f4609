"""The local engine's served model name, for the bodies the gRPC front door builds.

    GET /v1/models ─▶ {"object": "list", "data": [{"id": "<model>", ...}, ...]} ─▶ data[0].id

Cached for the life of the process. Deliberate limits: a failed lookup is not cached, and
fails as ``EngineNotReady`` (gRPC UNAVAILABLE: a router retries elsewhere).
Why a lookup, and why the first entry: docs/extending/design-notes.md#engine-model
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Final

from sidecar import jsonutil
from sidecar.errors import EngineNotReady, Stage
from sidecar.http1 import EngineClient, UpstreamError

MODELS_PATH: Final = "/v1/models"
_MAX_BYTES: Final = 1024 * 1024


class EngineModel:
    """Looks up (once) the model the local engine serves."""

    def __init__(self, session: EngineClient, engine_url: str, *, timeout_s: float,
                 stage: Stage = Stage.DECODE) -> None:
        self._session = session
        self._url = engine_url.rstrip("/") + MODELS_PATH
        self._timeout_s = timeout_s
        self._stage = stage
        self._name: str | None = None
        self._lock = asyncio.Lock()

    async def name(self) -> str:
        """The served model name; raises ``EngineNotReady`` when the engine cannot say."""
        if self._name is not None:
            return self._name
        async with self._lock:
            if self._name is None:
                self._name = await self._fetch()
            return self._name

    async def _fetch(self) -> str:
        try:
            async with asyncio.timeout(self._timeout_s):
                async with await self._session.get(self._url) as response:
                    raw = await response.read(_MAX_BYTES)
                    status = response.status
        except (UpstreamError, TimeoutError):
            raise self._not_ready(f"local engine did not answer {MODELS_PATH}") from None
        if status != 200 or len(raw) > _MAX_BYTES:
            raise self._not_ready(f"local engine answered {MODELS_PATH} with HTTP {status}")
        try:
            payload = jsonutil.loads(raw)
        except jsonutil.JSONDecodeError:
            payload = None
        name = _first_model(payload)
        if name is None:
            raise self._not_ready(f"local engine's {MODELS_PATH} lists no model")
        return name

    def _not_ready(self, message: str) -> EngineNotReady:
        return EngineNotReady(message, stage=self._stage)


def _first_model(payload: object) -> str | None:
    if not isinstance(payload, Mapping):
        return None
    data = payload.get("data")
    if not isinstance(data, list) or not data or not isinstance(data[0], Mapping):
        return None
    model = data[0].get("id")
    return model if isinstance(model, str) and model else None
