"""The composition root of one worker process of a pool: ``python -m sidecar.worker ...``.

Started by ``sidecar.workers.supervisor`` only. Reads the settings the supervisor resolved
(``D/settings.json``: flags, environment and pod labels are read once, by the supervisor, and
the ports are the ones it holds), then serves exactly as ``disagg-sidecar serve`` does, as
worker I of N (``sidecar.serve.run_server``): SIGTERM or SIGINT drains it; so does the end of
the lifeline pipe (the supervisor gone). Once listening it writes its bound ports as one JSON
line to the report pipe and closes it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from sidecar import jsonutil
from sidecar.config.settings import Settings
from sidecar.loop import run_async
from sidecar.observability.logs import configure_logging
from sidecar.workers.identity import SETTINGS_FILE, WorkerIdentity

logger = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sidecar.worker")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--report-fd", type=int, required=True)
    parser.add_argument("--lifeline-fd", type=int, required=True)
    return parser


async def serve_worker(
    settings: Settings, worker: WorkerIdentity, report_fd: int, lifeline_fd: int
) -> int:
    from sidecar.serve import freeze_startup_objects, run_server

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def supervisor_gone() -> None:
        # The supervisor never writes: readable means end-of-file, it has exited.
        loop.remove_reader(lifeline_fd)
        if not stop.is_set():
            logger.warning("worker %d: the supervisor is gone; draining", worker.index)
            stop.set()

    loop.add_reader(lifeline_fd, supervisor_gone)

    def report(ports: dict[str, int]) -> None:
        os.write(report_fd, jsonutil.dumps(ports) + b"\n")
        os.close(report_fd)
        freeze_startup_objects(ports)

    return await run_server(settings, stop, report, worker=worker)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    settings = Settings.model_validate_json((args.run_dir / SETTINGS_FILE).read_bytes())
    configure_logging(settings.log_level, settings.log_format, worker=args.index)
    worker = WorkerIdentity(args.index, args.count, args.run_dir)

    return run_async(serve_worker(settings, worker, args.report_fd, args.lifeline_fd))


if __name__ == "__main__":
    sys.exit(main())
