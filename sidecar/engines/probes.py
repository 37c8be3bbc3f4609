"""Health probes of prefill targets whose circuit breaker is open.

    breaker opens ─▶ probe task for that target: GET <target>/health every 0.5-0.75 s
                     (jittered), each within its own short deadline
                     ├─ down (refused, no answer, not 200) ─▶ breakers.probed(target, False)
                     └─ 200 ─▶ breakers.probed(target, True): after a down answer, the
                                cool-down ends now and the next leg is a trial
    the breaker leaves open (half-open, closed) ─▶ the task ends; close() ─▶ all end

An engine killed and restarted under load opened its breaker, and each failed trial doubled
the cool-down (up to 8 x ``--prefill-breaker-open-s``), so a recovered engine waited minutes
for legs. Probed, it gets a trial leg within about a second of answering its health
endpoint again, and legs once the trials answer. Probes cost the other targets nothing:
they run beside the requests, one task per open breaker, and no request waits for them.

Deliberate limits: at most ``MAX_PROBES`` targets probed at once (past that an open breaker
waits out its cool-down); ``/health`` is every engine family's health path; a probe follows
no redirect and reads no body past a small cap.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Final

from sidecar.http1 import EngineClient, UpstreamError
from sidecar.protocol.context import PrefillTarget
from sidecar.targets.breaker import BreakerState, CircuitBreakers
from sidecar.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

HEALTH_PATH: Final = "/health"
#: Seconds between two probes of one target: this, plus up to half of it at random.
PROBE_INTERVAL_S: Final = 0.5
#: Targets probed at once, at most.
MAX_PROBES: Final = 64
#: A probe's answer is empty or tiny; more is not read.
_MAX_ANSWER: Final = 4096


class BreakerProbes:
    """One probe task per prefill target whose breaker is open (see the module docstring)."""

    def __init__(self, session: EngineClient, *, timeout_s: float,
                 interval_s: float = PROBE_INTERVAL_S, rng: random.Random | None = None) -> None:
        self._session = session
        self._timeout_s = timeout_s
        self._interval_s = interval_s
        self._rng = rng or random.Random()
        self._tasks: dict[PrefillTarget, asyncio.Task[None]] = {}
        self._closed = False
        #: Set once the breakers exist (they call ``changed`` on every change).
        self.breakers: CircuitBreakers | None = None

    @property
    def probing(self) -> frozenset[PrefillTarget]:
        """The targets probed now."""
        return frozenset(self._tasks)

    def changed(self, target: PrefillTarget, new: BreakerState) -> None:
        """A breaker changed state: an open one is probed (its task ends by itself when the
        breaker leaves open)."""
        if (new is not BreakerState.OPEN or self._closed or target in self._tasks
                or len(self._tasks) >= MAX_PROBES):
            return
        task = asyncio.ensure_future(self._probe(target))
        self._tasks[target] = task
        task.add_done_callback(lambda _: self._tasks.pop(target, None))

    async def _probe(self, target: PrefillTarget) -> None:
        breakers = self.breakers
        assert breakers is not None
        url = target.base_url + HEALTH_PATH
        while breakers.state(target) is BreakerState.OPEN:
            # Jittered: the probes of many sidecars do not arrive together.
            await asyncio.sleep(self._interval_s * (1 + self._rng.random() / 2))
            if breakers.state(target) is not BreakerState.OPEN:
                break
            breakers.probed(target, await self._healthy(url, target.tls_name))

    async def _healthy(self, url: str, tls_name: str | None) -> bool:
        try:
            async with asyncio.timeout(self._timeout_s):
                response = await self._session.request("GET", url, server_hostname=tls_name)
                async with response:
                    await response.read(_MAX_ANSWER)
                    return response.status == 200
        except (UpstreamError, TimeoutError):
            return False

    async def close(self) -> None:
        """Stop every probe (shutdown)."""
        self._closed = True
        await cancel_and_wait(*self._tasks.values())
