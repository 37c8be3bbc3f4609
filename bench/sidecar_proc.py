"""Run ``disagg-sidecar serve`` in this process, for the benchmark.

It goes through the real composition root's serve path (``sidecar.__main__._serve``: settings
loader, logging, uvloop, ``serve_until_signalled``) but builds only the ``serve`` flags, so a
benchmark run does not depend on the other sub-commands importing cleanly.

    python -m bench.sidecar_proc --engine vllm --port 0 --ports-file F ...
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from sidecar.__main__ import _serve
from sidecar.config_loader import add_settings_arguments


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disagg-sidecar serve (bench)")
    add_settings_arguments(parser)
    return _serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
