"""Run ``disagg-sidecar serve`` in this process, for the benchmark.

It goes through the real composition root's serve path (``sidecar.__main__._serve``: settings
loader, logging, uvloop, ``serve_until_signalled``) but builds only the ``serve`` flags, so a
benchmark run does not depend on the other sub-commands importing cleanly.

    python -m bench.sidecar_proc --engine vllm --port 0 --ports-file F ...

With ``BENCH_CPROFILE=FILE`` in the environment it runs under ``cProfile`` with a CPU-time
clock (``time.process_time``) and writes the stats to FILE on exit: unlike a wall-clock
sampler, time the process spends preempted on a busy machine is not charged to it.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import sys
import time
from collections.abc import Sequence

from sidecar.__main__ import _serve
from sidecar.config.loader import add_settings_arguments


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disagg-sidecar serve (bench)")
    add_settings_arguments(parser)
    args = parser.parse_args(argv)
    stats_file = os.environ.get("BENCH_CPROFILE")
    if not stats_file:
        return _serve(args)
    profiler = cProfile.Profile(time.process_time)
    try:
        code: int = profiler.runcall(_serve, args)
    finally:
        profiler.dump_stats(stats_file)
    return code


if __name__ == "__main__":
    sys.exit(main())
