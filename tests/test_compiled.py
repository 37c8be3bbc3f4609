"""The compiled build of the hot modules and its pure-Python fallback (``setup.py``,
``sidecar/compiled.py``).

Proves: every module ``HOT`` names is a module of the package; an extension module left in
the source tree is never older than its ``.py`` (Python imports the extension first, so a
stale one would run code that is no longer in the source); the build is the pure-Python one
unless ``SIDECAR_COMPILE`` asks, and without a C compiler ``SIDECAR_COMPILE=auto`` falls back
to it while ``SIDECAR_COMPILE=1`` fails; in CI's compiled job
(``SIDECAR_EXPECT_COMPILED=1``) every hot module runs compiled, so that job cannot pass on
the pure build by accident.
Does not prove the compiled modules' behaviour: the suites do, run against that build.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar import compiled

REPO = Path(__file__).resolve().parents[1]


def _source(name: str) -> Path:
    return REPO / (name.replace(".", "/") + ".py")


def test_every_hot_module_is_a_module_of_the_package() -> None:
    assert compiled.HOT, "the compiled build compiles nothing"
    assert len(set(compiled.HOT)) == len(compiled.HOT)
    for name in compiled.HOT:
        assert name.startswith("sidecar.") and _source(name).is_file(), name


def test_no_extension_in_the_source_tree_is_older_than_its_source() -> None:
    stale = []
    for name in compiled.HOT:
        source = _source(name)
        for extension in source.parent.glob(source.stem + ".*.so"):
            if extension.stat().st_mtime < source.stat().st_mtime:
                stale.append(str(extension.relative_to(REPO)))
    assert not stale, (
        f"{stale}: older than the source beside it, yet imported instead of it: rebuild "
        "(`SIDECAR_COMPILE=1 python setup.py build_ext --inplace`) or delete them")


@pytest.mark.skipif(os.environ.get("SIDECAR_EXPECT_COMPILED", "") in ("", "0"),
                    reason="only in the compiled build's job (SIDECAR_EXPECT_COMPILED=1)")
def test_in_the_compiled_job_every_hot_module_runs_compiled() -> None:
    for name in compiled.HOT:
        importlib.import_module(name)
    assert compiled.modules() == list(compiled.HOT), (
        f"pure Python: {sorted(set(compiled.HOT) - set(compiled.modules()))}")


def _build_copy(tmp_path: Path) -> Path:
    """The files the build reads, with one hot module to compile (a minute less)."""
    tree = tmp_path / "tree"
    (tree / "sidecar").mkdir(parents=True)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, tree / name)
    shutil.copy(REPO / "sidecar" / "__init__.py", tree / "sidecar" / "__init__.py")
    text = (REPO / "sidecar" / "compiled.py").read_text()
    start = text.index("HOT: Final[tuple[str, ...]] = (")
    end = text.index(")", start + len("HOT: Final[tuple[str, ...]] = ("))
    (tree / "sidecar" / "compiled.py").write_text(
        text[:start] + 'HOT: Final[tuple[str, ...]] = ("sidecar.jsonutil",' + text[end:])
    shutil.copy(REPO / "sidecar" / "jsonutil.py", tree / "sidecar" / "jsonutil.py")
    return tree


def _build_ext(tree: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree,
        env={**os.environ, "CC": "no-such-cc", **env}, capture_output=True, text=True,
        timeout=300, check=False)


def test_the_build_is_pure_python_unless_asked_and_falls_back_only_when_told(
        tmp_path: Path) -> None:
    pytest.importorskip("Cython")
    tree = _build_copy(tmp_path)
    plain = _build_ext(tree)  # the default: not even an attempt
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "not compiled" not in plain.stderr
    auto = _build_ext(tree, SIDECAR_COMPILE="auto")
    assert auto.returncode == 0, auto.stderr[-3000:]
    assert "not compiled (RuntimeError: no C compiler (no-such-cc))" in auto.stderr
    assert not list((tree / "sidecar").glob("*.so"))
    asked = _build_ext(tree, SIDECAR_COMPILE="1")
    assert asked.returncode != 0
    assert "no C compiler" in asked.stderr
