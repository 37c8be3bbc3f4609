"""User-space instructions per PD request in the sidecar, under valgrind: a figure that does
not move with the machine's load, for before/after comparisons of hot-path changes.

    python -m bench.instructions [--format json|stream] [--sidecar-tree DIR]

It runs the benchmark's ``serial`` phase twice through the sidecar (``--modes sidecar``)
with the sidecar under ``valgrind --tool=callgrind``, ``small`` and ``large`` requests, and
divides the difference of the two instruction totals by the difference of the request
counts, so start-up and shutdown cancel out. Needs ``valgrind`` on PATH; takes a minute or two.

Deliberate limits: user-space instructions only (the kernel's share of each send and receive
is not counted); one request at a time (no batching effects of concurrency).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench import run


def _instructions(callgrind_out: Path) -> int:
    for line in callgrind_out.read_text(errors="replace").splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError(f"no summary line in {callgrind_out}")


def measure(n: int, fmt: str, workdir: Path, tree: Path | None) -> int:
    out = workdir / f"callgrind-{n}.out"
    argv = [
        "--flows", "seq", "--phases", f"{fmt}/serial", "--modes", "sidecar",
        "--serial-n", str(n), "--out", str(workdir / f"result-{n}.json"),
        "--sidecar-prefix", f"valgrind --tool=callgrind --callgrind-out-file={out}",
    ]
    if tree is not None:
        argv += ["--sidecar-tree", str(tree)]
    code = run.main(argv)
    if code != 0:
        raise RuntimeError(f"benchmark run with {n} requests failed ({code})")
    return _instructions(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.instructions")
    parser.add_argument("--format", choices=("json", "stream"), default="json")
    parser.add_argument("--small", type=int, default=100)
    parser.add_argument("--large", type=int, default=400)
    parser.add_argument("--sidecar-tree", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-instr-") as tmp:
        work = Path(tmp)
        small = measure(args.small, args.format, work, args.sidecar_tree)
        large = measure(args.large, args.format, work, args.sidecar_tree)
    per_request = (large - small) / (args.large - args.small)
    print(f"sidecar user-space instructions per PD request ({args.format}, one at a time): "
          f"{per_request:,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
