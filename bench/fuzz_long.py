"""The long fuzzing run: the properties of tests/fuzz with many more examples and random seeds.

    python -m bench.fuzz_long                      # 5,000 examples per property
    python -m bench.fuzz_long --examples 50000 -k grpc

CI runs the same properties with 200 derandomized examples (40 for the end-to-end ones);
this sets ``DISAGG_FUZZ_EXAMPLES`` so every property gets ``--examples`` and hypothesis picks
fresh random inputs each run. A failure prints hypothesis' minimal failing example, which
belongs in a regression test next to the property.

Deliberate limits: no coverage guidance (hypothesis' own search only); the end-to-end
properties run against stub engines on loopback, in this process's threads.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from bench.procs import REPO_ROOT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fuzz_long", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=5000,
                        help="examples per property (default 5000)")
    parser.add_argument("-k", dest="keyword", help="only properties matching (pytest -k)")
    args = parser.parse_args(argv)
    env = {**os.environ, "DISAGG_FUZZ_EXAMPLES": str(args.examples)}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "-o", "timeout=0", "--hypothesis-show-statistics", "tests/fuzz"]
    if args.keyword:
        command += ["-k", args.keyword]
    return subprocess.call(command, cwd=REPO_ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
