"""User-space instructions the sidecar runs per PD request or per paced token, under valgrind:
figures that do not move with the machine's load, for before/after comparisons of hot-path
changes, and (``--by-object``) which machine code runs them.

    python -m bench.instructions [--format json|stream|paced] [--sidecar-tree DIR]
                                 [--sidecar-python PATH] [--by-object]

``json`` and ``stream`` (per PD request): the benchmark's ``serial`` phase runs twice through
the sidecar (``--modes sidecar``) with the sidecar under ``valgrind --tool=callgrind``,
``--small`` and ``--large`` requests one at a time, and the difference of the two instruction
totals is divided by the difference of the request counts, so start-up and shutdown cancel
out. ``paced`` (per token): the paced mode's sidecar way (``--streams`` streams of
``--tokens`` tokens, ``--itl-ms`` apart, the vLLM flow) runs twice, with windows of
``--seconds`` and three times as long, and the difference of the totals is divided by the
difference of the tokens the two windows relayed: what each token of streams at an engine's
pace costs, the streams' per-request work spread over their tokens, as a router's paced
figure has it. ``--sidecar-python`` runs the sidecar on another interpreter (``bench.run``'s
flag: one built as the image's is, or another Python version), the count then that
interpreter's. ``--by-object`` splits the same difference by the machine code that ran it
(the interpreter, uvloop, llhttp, orjson, the C library, ...): each function's own
instructions, not its callees'. Python code of every library runs inside the interpreter's
share; ``python -m bench.bytecodes --by-package`` says whose Python it is. Needs ``valgrind``
on PATH; a request figure takes a minute or two, a token figure about two minutes.

Deliberate limits: user-space instructions only (the kernel's share of each send and receive
is not counted); the request figures one request at a time (no batching effects of
concurrency); the token figure also counts the sidecar's own timers over the longer window
(its engine health polls: a few thousand instructions a second, well under 1 % of a token's
work at the default pace).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from bench import run

#: How many objects ``--by-object`` names before it sums the rest.
SHOWN_OBJECTS = 12


def instructions_of(callgrind_out: Path) -> int:
    """The run's total instructions (its ``summary:`` line)."""
    for line in callgrind_out.read_text(errors="replace").splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError(f"no summary line in {callgrind_out}")


_NAMED = re.compile(r"^(c?ob|c?fn)=(?:\((\d+)\))?\s*(.*)$")


def instructions_by_function(callgrind_out: Path) -> Counter[tuple[str, str]]:
    """Each function's own instructions in one callgrind output (the first event), keyed by
    (object file, function).

    Callgrind's format: ``ob=`` names the object and ``fn=`` the function of the cost lines
    that follow (each compressed as ``(id) name`` once, ``(id)`` after; ``cob=`` and ``cfn=``
    share their tables); a cost line is the position columns and then the costs; the cost
    line right after ``calls=`` is the call's inclusive cost, counted in the callee's own
    lines already, so it is skipped here.
    """
    names: dict[tuple[str, str], str] = {}
    by_function: Counter[tuple[str, str]] = Counter()
    current = {"ob": "?", "fn": "?"}
    positions = 1
    skip_next = False
    with callgrind_out.open(errors="replace") as lines:
        for line in lines:
            if not line or line[0] in "#\n":
                continue
            head = line[0]
            if head.isdigit() or head in "+-*":
                if skip_next:
                    skip_next = False
                    continue
                fields = line.split()
                if len(fields) > positions:
                    by_function[current["ob"], current["fn"]] += int(fields[positions])
                continue
            if line.startswith("calls="):
                skip_next = True
                continue
            if line.startswith("positions:"):
                positions = len(line.split()) - 1
                continue
            spec = _NAMED.match(line.rstrip("\n"))
            if spec is None:
                continue
            key, ident, name = spec.groups()
            table = key[-2:]  # ``cob`` names into ``ob``'s table, ``cfn`` into ``fn``'s
            if ident is not None and name:
                names[table, ident] = name
            if key == table:
                current[table] = names.get((table, ident), name) if ident is not None else name
    return by_function


def instructions_by_object(callgrind_out: Path) -> Counter[str]:
    """Each object file's own instructions in one callgrind output, a package's extension
    modules together (``instructions_by_function`` summed by object)."""
    labelled: Counter[str] = Counter()
    for (path, _), cost in instructions_by_function(callgrind_out).items():
        labelled[_object_label(path)] += cost
    return labelled


def _object_label(path: str) -> str:
    """A short name for an object file: the package of an extension module, the library's
    file name otherwise (``libpython3.11.so.1.0``, ``libc.so.6``)."""
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1].split("/", 1)[0]
    if "/lib-dynload/" in path:
        return "stdlib " + path.rsplit("/", 1)[1].split(".", 1)[0]
    return path.rsplit("/", 1)[-1]


@dataclass(frozen=True, slots=True)
class Count:
    """One run under callgrind: its units (requests or tokens) and its outputs."""

    units: int
    outputs: tuple[Path, ...]

    def total(self) -> int:
        return sum(instructions_of(out) for out in self.outputs)

    def by_object(self) -> Counter[str]:
        summed: Counter[str] = Counter()
        for out in self.outputs:
            summed.update(instructions_by_object(out))
        return summed

    def by_function(self) -> Counter[tuple[str, str]]:
        summed: Counter[tuple[str, str]] = Counter()
        for out in self.outputs:
            summed.update(instructions_by_function(out))
        return summed


def _prefix(outputs: str) -> str:
    return f"valgrind --tool=callgrind --callgrind-out-file={outputs}"


def sidecar_flags(tree: Path | None, python: str | None) -> list[str]:
    """``bench.run``'s flags for the sidecar's tree and interpreter, where not the bench's."""
    argv = [] if tree is None else ["--sidecar-tree", str(tree)]
    return argv if python is None else [*argv, "--sidecar-python", python]


def count_requests(n: int, fmt: str, workdir: Path, tree: Path | None,
                   python: str | None = None) -> Count:
    """``n`` PD requests one at a time through the sidecar under callgrind."""
    out = workdir / f"callgrind-{fmt}-{n}.out"
    argv = [
        "--flows", "seq", "--phases", f"{fmt}/serial", "--modes", "sidecar",
        "--serial-n", str(n), "--out", str(workdir / f"result-{n}.json"),
        "--sidecar-prefix", _prefix(str(out)), *sidecar_flags(tree, python),
    ]
    code = run.main(argv)
    if code != 0:
        raise RuntimeError(f"benchmark run with {n} requests failed ({code})")
    return Count(n, (out,))


@dataclass(frozen=True, slots=True)
class PacedPlan:
    """The paced run counted per token (``bench.run --mode paced``'s flags)."""

    streams: int = 8
    tokens: int = 64
    itl_ms: float = 50.0
    seconds: float = 6.0


_PACED = PacedPlan()  # the defaults (a slotted class's attributes are descriptors)


def count_tokens(plan: PacedPlan, seconds: float, workdir: Path, tree: Path | None,
                 python: str | None = None) -> Count:
    """The paced mode's sidecar way for a window of ``seconds``; its units are the tokens the
    window relayed."""
    stem = f"paced-{seconds:g}"
    result = workdir / f"{stem}.json"
    argv = [
        "--mode", "paced", "--flows", "seq", "--modes", "sidecar", "--no-bare",
        "--streams", str(plan.streams), "--tokens", str(plan.tokens),
        "--itl-ms", str(plan.itl_ms), "--seconds", str(seconds), "--out", str(result),
        # One file per process (%p): the sidecar's, whatever it starts under the prefix.
        "--sidecar-prefix", _prefix(str(workdir / f"{stem}.%p.out")),
        *sidecar_flags(tree, python),
    ]
    code = run.main(argv)
    if code != 0:
        raise RuntimeError(f"paced run of {seconds:g} s failed ({code})")
    tokens = sum(window[str(plan.streams)]["sidecar"]["tokens"]
                 for window in json.loads(result.read_text())["flows"]["seq"]["rounds"])
    return Count(tokens, tuple(sorted(workdir.glob(f"{stem}.*.out"))))


def per_unit(small: Count, large: Count) -> float:
    """Instructions per unit: the difference of the totals over that of the units."""
    units = large.units - small.units
    if units <= 0:
        raise RuntimeError(f"the longer run counted no more units ({small.units} -> "
                           f"{large.units})")
    return (large.total() - small.total()) / units


def objects_table(small: Count, large: Count, shown: int = SHOWN_OBJECTS) -> list[str]:
    """Lines of the per-unit split by object, the largest first, the rest summed."""
    units = large.units - small.units
    difference = large.by_object()
    difference.subtract(small.by_object())
    rows = sorted(difference.items(), key=lambda item: -item[1])
    whole = sum(difference.values())
    lines = []
    for name, cost in rows[:shown]:
        lines.append(_row(name, cost / units, cost / whole if whole else 0.0))
    rest = sum(cost for _, cost in rows[shown:])
    if rows[shown:]:
        lines.append(_row(f"({len(rows) - shown} more)", rest / units,
                          rest / whole if whole else 0.0))
    return lines


def functions_table(small: Count, large: Count, shown: int) -> list[str]:
    """Lines of the ``shown`` functions that run the most instructions per unit (each
    function's own, the difference of the two runs over that of their units), with their
    object: what a per-request count of bytecodes does not show, the C a bytecode calls."""
    units = large.units - small.units
    difference = large.by_function()
    difference.subtract(small.by_function())
    rows = sorted(difference.items(), key=lambda item: -item[1])[:shown]
    return [f"  {cost / units:>10,.0f}  {function}  [{_object_label(path)}]"
            for (path, function), cost in rows]


def _row(name: str, per: float, share: float) -> str:
    return f"  {name:<32} {per:>10,.0f}  {share:6.1%}"


def report(label: str, small: Count, large: Count, by_object: bool,
           by_function: int = 0) -> Iterable[str]:
    yield f"sidecar user-space instructions per {label}: {per_unit(small, large):,.0f}"
    if by_object:
        yield "  by object (each function's own instructions):"
        yield from objects_table(small, large)
    if by_function:
        yield f"  the {by_function} functions that run the most (their own instructions):"
        yield from functions_table(small, large, by_function)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.instructions")
    parser.add_argument("--format", choices=("json", "stream", "paced"), default="json")
    parser.add_argument("--small", type=int, default=100, help="json/stream: requests, short run")
    parser.add_argument("--large", type=int, default=400, help="json/stream: requests, long run")
    parser.add_argument("--streams", type=int, default=_PACED.streams, help="paced")
    parser.add_argument("--tokens", type=int, default=_PACED.tokens, help="paced")
    parser.add_argument("--itl-ms", type=float, default=_PACED.itl_ms, help="paced")
    parser.add_argument("--seconds", type=float, default=_PACED.seconds,
                        help="paced: the short window (the long one is three times as long)")
    parser.add_argument("--sidecar-tree", type=Path)
    parser.add_argument("--sidecar-python",
                        help="the interpreter the sidecar runs on (bench.run's flag)")
    parser.add_argument("--by-object", action="store_true",
                        help="also split the figure by the object file that ran it")
    parser.add_argument("--by-function", type=int, default=0, metavar="N",
                        help="also list the N functions (Python's C, the extensions') that "
                             "run the most instructions per unit")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-instr-") as tmp:
        work = Path(tmp)
        if args.format == "paced":
            plan = PacedPlan(args.streams, args.tokens, args.itl_ms, args.seconds)
            small = count_tokens(plan, plan.seconds, work, args.sidecar_tree,
                                 args.sidecar_python)
            large = count_tokens(plan, 3 * plan.seconds, work, args.sidecar_tree,
                                 args.sidecar_python)
            label = (f"paced token ({plan.streams} streams of {plan.tokens} tokens, "
                     f"{plan.itl_ms:g} ms apart; {small.units:,} and {large.units:,} tokens)")
        else:
            small = count_requests(args.small, args.format, work, args.sidecar_tree,
                                   args.sidecar_python)
            large = count_requests(args.large, args.format, work, args.sidecar_tree,
                                   args.sidecar_python)
            label = f"PD request ({args.format}, one at a time)"
        for line in report(label, small, large, args.by_object, args.by_function):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
