"""Prefill calls that outlive their request: a concurrent dialect's gRPC Prefill returns its
hand-off at once while the engine call (which blocks until a decode connects) runs on here."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from sidecar.errors import SidecarError, Stage
from sidecar.request.scope import Scopes
from sidecar.tasks import cancel_and_wait

logger = logging.getLogger(__name__)


class BackgroundPrefills:
    """The running background prefills: each is counted, logged when it fails, and ends by
    calling its ``done`` (the request's dialect state and admission slot go back there)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def run(self, call: Awaitable[object], request_id: str, scopes: Scopes,
            done: Callable[[], None]) -> None:
        """Run ``call`` (the engine's prefill) to its end, whatever becomes of the request."""
        task = asyncio.ensure_future(self._watched(call, request_id, scopes, done))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watched(self, call: Awaitable[object], request_id: str, scopes: Scopes,
                       done: Callable[[], None]) -> None:
        started = time.perf_counter()
        try:
            await call
            scopes.observe("prefill", time.perf_counter() - started)
        except SidecarError as error:
            scopes.count_error(error)
            logger.warning("request %s: background prefill failed after the hand-off: %s (%s)",
                           request_id, error.code, error.message)
        except asyncio.CancelledError:
            logger.info("request %s: background prefill cancelled", request_id)
            raise
        except Exception:
            scopes.count_error(SidecarError("background prefill crashed", stage=Stage.PREFILL))
            logger.exception("request %s: background prefill crashed", request_id)
        finally:
            done()

    async def close(self) -> None:
        """Cancel the background prefills still running (server stop)."""
        await cancel_and_wait(*self._tasks)
