"""What a stub received and decided, for tests to await and assert on (no sleeps).

- Every request on the stub's HTTP app is recorded (method, path, headers, raw body, parsed
  JSON) before it is handled; ``await recorder.next_request("/v1/completions")`` returns the
  next one on that path not yet returned (waiting for it if needed).
- Every hand-off decision of a decode (``remote`` or ``local`` with a reason) is recorded as
  a ``Decision``: the stub never puts it in the response body (the real engines do not), so
  this and the ``stub_handoff_total`` metric are how tests see it.
- In-flight requests and cancellations are counted; ``wait_idle()`` returns once nothing is
  in flight, so a test can assert an upstream request ended after its client went away.

Deliberate limits: keeps the last ``limit`` requests (0 = counts only, no bodies) so a
benchmark can run for long; waits take a timeout (default 10 s) so a broken test fails
instead of hanging.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sidecar.tools.stubs.handoff import Tally, Verdict

DEFAULT_WAIT_S = 10.0


@dataclass(frozen=True)
class RecordedRequest:
    seq: int
    method: str
    path: str
    query: dict[str, str]
    headers: Mapping[str, str]
    body: bytes
    json: Any


@dataclass(frozen=True)
class Decision:
    """A decode's verdict on the hand-off it was given."""

    path: str
    request_id: str
    outcome: str  # "remote" | "local"
    reason: str  # "ok", "missing_params", "pull_failed", "prompt_mismatch", ...


@dataclass
class Recorder:
    limit: int = 10_000
    requests: deque[RecordedRequest] = field(init=False)
    decisions: list[Decision] = field(default_factory=list)
    tally: Tally = field(default_factory=Tally)
    total: int = 0
    in_flight: int = 0
    completed: int = 0
    cancelled: int = 0
    _cursor: dict[str, int] = field(default_factory=dict)
    _cond: asyncio.Condition | None = None
    _waiting: int = 0
    _dropped_decisions: int = 0

    def __post_init__(self) -> None:
        self.requests = deque(maxlen=max(self.limit, 1))

    @property
    def cond(self) -> asyncio.Condition:
        # Created lazily so the recorder can be built outside a running loop.
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def _notify(self) -> None:
        async with self.cond:
            self.cond.notify_all()

    # -- called by the server ------------------------------------------------------------

    def start(self, entry: RecordedRequest | None) -> None:
        self.total += 1
        self.in_flight += 1
        if entry is not None and self.limit > 0:
            self.requests.append(entry)
        self._wake()

    def finish(self, *, cancelled: bool) -> None:
        self.in_flight -= 1
        self.completed += 1
        if cancelled:
            self.cancelled += 1
        self._wake()

    @property
    def handoff_counts(self) -> Counter[tuple[str, str]]:
        return self.tally.counts

    def judge(self, path: str, request_id: str, verdict: Verdict) -> None:
        """Record a decode's verdict (counted, and kept for ``next_decision``)."""
        self.decide(path, request_id, verdict.outcome, verdict.reason)

    def decide(self, path: str, request_id: str, outcome: str, reason: str) -> None:
        self.tally.counts[(outcome, reason)] += 1
        if self.limit > 0:
            if len(self.decisions) >= self.limit:
                drop = len(self.decisions) // 2 or 1
                del self.decisions[:drop]
                self._dropped_decisions += drop
            self.decisions.append(Decision(path, request_id, outcome, reason))
        self._wake()

    def _wake(self) -> None:
        # Cheap on the hot path: a task only when a test is waiting.
        if self._waiting:
            asyncio.get_running_loop().create_task(self._notify())

    # -- for tests -------------------------------------------------------------------------

    async def next_request(
        self, path: str, *, timeout_s: float = DEFAULT_WAIT_S
    ) -> RecordedRequest:
        """The next request on ``path`` this method has not returned yet."""

        def find() -> RecordedRequest | None:
            after = self._cursor.get(path, 0)
            for entry in self.requests:
                if entry.path == path and entry.seq > after:
                    return entry
            return None

        self._waiting += 1
        try:
            async with asyncio.timeout(timeout_s), self.cond:
                entry = find()
                while entry is None:
                    await self.cond.wait()
                    entry = find()
        finally:
            self._waiting -= 1
        self._cursor[path] = entry.seq
        return entry

    async def next_decision(self, *, timeout_s: float = DEFAULT_WAIT_S) -> Decision:
        """The next hand-off decision this method has not returned yet."""
        # Absolute positions, so decisions dropped by the limit do not shift the cursor.
        index = max(self._cursor.get("\0decisions", 0), self._dropped_decisions)
        await self._wait_for(
            lambda: len(self.decisions) + self._dropped_decisions > index, timeout_s
        )
        index = max(index, self._dropped_decisions)
        self._cursor["\0decisions"] = index + 1
        return self.decisions[index - self._dropped_decisions]

    async def wait_idle(self, *, timeout_s: float = DEFAULT_WAIT_S) -> None:
        """Return once no request is in flight on the stub."""
        await self._wait_for(lambda: self.in_flight == 0, timeout_s)

    async def wait_count(self, n: int, *, timeout_s: float = DEFAULT_WAIT_S) -> None:
        """Return once at least ``n`` requests have been received in total."""
        await self._wait_for(lambda: self.total >= n, timeout_s)

    async def _wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        self._waiting += 1
        try:
            async with asyncio.timeout(timeout_s), self.cond:
                await self.cond.wait_for(predicate)
        finally:
            self._waiting -= 1

    def on_path(self, path: str) -> list[RecordedRequest]:
        return [r for r in self.requests if r.path == path]

    def stats(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "in_flight": self.in_flight,
            "completed": self.completed,
            "cancelled": self.cancelled,
            "handoff": [
                {"outcome": o, "reason": r, "count": c} for (o, r), c in self.handoff_counts.items()
            ],
        }
