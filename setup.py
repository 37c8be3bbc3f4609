"""The build: pyproject.toml's package, with the request path's hot modules compiled where it can.

Where Cython and a C compiler are present, each module named in ``sidecar/compiled.py``
(``HOT``) is compiled from its own ``.py`` file into an extension module installed beside it;
Python imports the extension first. Where they are not (no compiler, no Python headers), or
with ``SIDECAR_PURE_PYTHON=1``, or in an editable install (``pip install -e``, where a
stale extension would hide an edited source), the same ``.py`` files are the build, as aiohttp,
yarl and multidict fall back to theirs. ``SIDECAR_COMPILE=1`` makes a failed compile an
error instead (CI's compiled job), and compiles in an editable install too. (Not ``DISAGG_*``
names: that prefix is the settings', and the sidecar warns about a variable it does not know.)

Deliberate limits: the extensions are CPython-version specific (the wheel is too, once one
compiled); the Cython directives keep Python's semantics (annotations are not enforced as C
types, so the test suites' fakes pass where the annotation names a class).
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _hot_modules() -> list[str]:
    namespace: dict[str, object] = {}
    exec((ROOT / "sidecar" / "compiled.py").read_text(), namespace)  # no imports of the package
    hot = namespace["HOT"]
    assert isinstance(hot, tuple)
    return list(hot)


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def _editable() -> bool:
    return any(arg in ("editable_wheel", "develop") for arg in sys.argv)


#: Cython's directives: Python's semantics kept. Annotations are not enforced as C types, so
#: a parameter annotated with a class accepts a test's fake, None where the code allows it, a
#: subclass of int.
DIRECTIVES = {
    "annotation_typing": False,
    "binding": True,
    "embedsignature": False,
    "always_allow_keywords": True,
}


class OptionalBuildExt(build_ext):
    """``build_ext`` that turns the hot modules' ``.py`` files into C with Cython when it
    runs (never when pip only asks for the build's metadata) and leaves the pure-Python build
    in place when that or a compile fails (unless ``SIDECAR_COMPILE=1``)."""

    def run(self) -> None:
        if not self.extensions:
            return
        missing = _missing_toolchain()
        if missing is not None:
            self._fall_back(RuntimeError(missing))
            return
        try:
            from Cython.Build import cythonize

            generated = cythonize(self.extensions, language_level=3, quiet=True,
                                  nthreads=self.parallel or 0, compiler_directives=DIRECTIVES)
            # The C files onto setuptools' own extensions (finalized: cythonize made new ones).
            sources = {extension.name: extension.sources for extension in generated}
            for extension in self.extensions:
                extension.sources = sources[extension.name]
            super().run()
        except Exception as exc:
            self._fall_back(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._fall_back(exc)

    def _fall_back(self, exc: Exception) -> None:
        if _flag("SIDECAR_COMPILE"):
            raise exc
        print(f"disagg-sidecar: not compiled ({type(exc).__name__}: {exc}); the pure-Python "
              "modules are the build", file=sys.stderr)


def _missing_toolchain() -> str | None:
    """What a compile would lack (checked before Cython spends a minute writing C)."""
    compiler = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        return f"no C compiler ({compiler})"
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.exists():
        return f"no Python headers ({headers})"
    return None


def _extensions() -> list[Extension]:
    if _flag("SIDECAR_PURE_PYTHON"):
        return []
    if _editable() and not _flag("SIDECAR_COMPILE"):
        return []
    # Cython's generated C leaves helpers unused: not worth a warning per module.
    flags = [] if sys.platform == "win32" else ["-Wno-unused-function"]
    return [Extension(name, [name.replace(".", "/") + ".py"], extra_compile_args=flags)
            for name in _hot_modules()]


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
