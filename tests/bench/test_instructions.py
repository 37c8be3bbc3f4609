"""``bench.instructions``' reading of callgrind's output: the totals and the splits by object
and by function.

Proves: each object's (and each function's) own instructions are the cost lines under its
``ob=`` (``fn=``), names given once (compressed ids, a name first met on a ``cob=`` or
``cfn=`` line) and referred to by id after; a call's
inclusive cost line (the one after ``calls=``) is not counted again; the extension modules of
one package add up under the package's name; a per-unit figure is the difference of two runs
over the difference of their units. Does not prove valgrind's figures: no valgrind runs here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.instructions import (
    Count,
    functions_table,
    instructions_by_function,
    instructions_by_object,
    instructions_of,
    objects_table,
    per_unit,
    sidecar_flags,
)

SITE = "/venv/lib/python3.11/site-packages"

#: A callgrind dump in the tool's own shape: ``main`` in libpython calls into the aiohttp
#: parser (named first on its ``cob=`` line), which calls libc and then runs on; two positions per
#: cost line.
DUMP = f"""version: 1
creator: callgrind-3.19.0
positions: instr line
events: Ir
summary: {{summary}}

ob=(1) /usr/lib/libpython3.11.so.1.0
fl=(1) ceval.c
fn=(1) main
0x10 3 {{python}}
cob=(2) {SITE}/aiohttp/_http_parser.cpython-311-x86_64-linux-gnu.so
cfi=(2) parser.c
cfn=(2) parse
calls=1 0x20 5
0x11 4 999

ob=(2)
fl=(2)
fn=(2)
0x20 5 {{parser}}
+1 +1 1
cob=(3) /lib/libc.so.6
cfi=(3) memcpy.S
cfn=(3) memcpy
calls=2 0x30 1
* * 888
+2 +1 3

ob=(3)
fl=(3)
fn=(3)
0x30 1 {{libc}}

ob=(4) {SITE}/aiohttp/_http_writer.cpython-311-x86_64-linux-gnu.so
fl=(4) writer.c
fn=(4) write
0x40 1 {{writer}}
"""


def dump(tmp_path: Path, name: str, python: int, parser: int, libc: int, writer: int) -> Path:
    path = tmp_path / name
    summary = python + parser + 1 + 3 + libc + writer
    path.write_text(DUMP.format(summary=summary, python=python, parser=parser, libc=libc,
                                writer=writer))
    return path


def test_each_object_counts_its_own_lines_and_a_package_adds_up(tmp_path: Path) -> None:
    path = dump(tmp_path, "one.out", python=100, parser=40, libc=7, writer=2)
    by_object = instructions_by_object(path)
    # The calls' inclusive lines (999, 888) are not counted; the parser's two lines are.
    assert by_object == {"libpython3.11.so.1.0": 100, "aiohttp": 40 + 1 + 3 + 2,
                         "libc.so.6": 7}
    assert sum(by_object.values()) == instructions_of(path)


def test_per_unit_is_the_difference_over_the_units(tmp_path: Path) -> None:
    small = Count(10, (dump(tmp_path, "small.out", python=1_000, parser=100, libc=10,
                            writer=0),))
    large = Count(30, (dump(tmp_path, "large.out", python=3_000, parser=500, libc=50,
                            writer=0),))
    assert per_unit(small, large) == pytest.approx((3_554 - 1_114) / 20)
    table = objects_table(small, large, shown=1)
    assert table[0].split() == ["libpython3.11.so.1.0", "100", "82.0%"]
    assert table[1].split() == ["(2", "more)", "22", "18.0%"]


def test_a_longer_run_without_more_units_is_refused(tmp_path: Path) -> None:
    path = dump(tmp_path, "same.out", python=1, parser=1, libc=1, writer=1)
    with pytest.raises(RuntimeError, match="no more units"):
        per_unit(Count(5, (path,)), Count(5, (path,)))


def test_each_function_counts_its_own_lines_under_its_object(tmp_path: Path) -> None:
    path = dump(tmp_path, "one.out", python=100, parser=40, libc=7, writer=2)
    assert instructions_by_function(path) == {
        ("/usr/lib/libpython3.11.so.1.0", "main"): 100,
        # Its own lines before and after its call into libc (a ``cfn=`` names the callee only).
        (f"{SITE}/aiohttp/_http_parser.cpython-311-x86_64-linux-gnu.so", "parse"): 40 + 1 + 3,
        ("/lib/libc.so.6", "memcpy"): 7,
        (f"{SITE}/aiohttp/_http_writer.cpython-311-x86_64-linux-gnu.so", "write"): 2,
    }


def test_the_functions_table_is_per_unit_and_the_largest_first(tmp_path: Path) -> None:
    small = Count(10, (dump(tmp_path, "small.out", python=1_000, parser=100, libc=10,
                            writer=0),))
    large = Count(30, (dump(tmp_path, "large.out", python=3_000, parser=900, libc=50,
                            writer=0),))
    assert [line.split() for line in functions_table(small, large, shown=3)] == [
        ["100", "main", "[libpython3.11.so.1.0]"],
        ["40", "parse", "[aiohttp]"],
        ["2", "memcpy", "[libc.so.6]"],
    ]


def test_the_sidecar_runs_from_the_tree_and_on_the_interpreter_it_is_given() -> None:
    """``--sidecar-tree`` and ``--sidecar-python`` reach ``bench.run`` as its own flags; with
    neither, the bench's own tree and interpreter run the sidecar."""
    assert sidecar_flags(None, None) == []
    assert sidecar_flags(Path("/tmp/before"), None) == ["--sidecar-tree", "/tmp/before"]
    assert sidecar_flags(Path("/tmp/before"), "/opt/py/bin/python") == [
        "--sidecar-tree", "/tmp/before", "--sidecar-python", "/opt/py/bin/python"]
    assert sidecar_flags(None, "/opt/py/bin/python") == ["--sidecar-python", "/opt/py/bin/python"]
