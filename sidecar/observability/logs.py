"""Process logging: plain text or one JSON object per line (``--log-format json``).

A pool's worker names itself on every line (``worker=I``; JSON: a ``worker`` field); a JSON
line written under a traced request's span carries its ``trace_id`` and ``span_id``.
"""

from __future__ import annotations

import json
import logging
import sys

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
