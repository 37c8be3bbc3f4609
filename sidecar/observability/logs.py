"""Process logging: plain text or one JSON object per line (``--log-format json``).

A pool's worker names itself on every line (``worker=I``; JSON: a ``worker`` field); a JSON
line written under a traced request's span carries its ``trace_id`` and ``span_id``.
``LogEvery`` bounds how often a line that may repeat per request is written (the first at
once, then at most one per interval, saying how many were left out).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable

from opentelemetry import trace


class _JsonFormatter(logging.Formatter):
    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self._worker = worker

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"), "level": record.levelname.lower(),
            "logger": record.name, "msg": record.getMessage(),
        }
        if self._worker is not None:
            entry["worker"] = self._worker
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            entry["trace_id"] = trace.format_trace_id(span.trace_id)
            entry["span_id"] = trace.format_span_id(span.span_id)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, separators=(",", ":"))


def configure_logging(level: str, fmt: str, worker: int | None = None) -> None:
    """Log to stderr at ``level`` in ``fmt``; ``worker``: this process's index in a pool."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter(worker))
    else:
        tag = "" if worker is None else f"worker={worker} "
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s {tag}%(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp's access log would cost a line per request on the hot path.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


class LogEvery:
    """At most one line per ``interval_s`` of something that may happen on every request."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._next_at: float | None = None
        self._left_out = 0

    def due(self) -> int | None:
        """None: do not log this one (it is counted). Else log it, and say that this many
        were left out since the last line."""
        now = self._clock()
        if self._next_at is not None and now < self._next_at:
            self._left_out += 1
            return None
        self._next_at = now + self._interval_s
        left_out, self._left_out = self._left_out, 0
        return left_out
