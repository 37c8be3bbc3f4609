"""The build: pyproject.toml's package, its request path's hot modules compiled on request.

``SIDECAR_COMPILE=1 pip install .`` compiles each module named in ``sidecar/compiled.py``
(``HOT``) with Cython from its own ``.py`` file into an extension module installed beside it
(Python imports the extension first), and fails where it cannot; ``SIDECAR_COMPILE=auto``
compiles where Cython, a C compiler and Python's headers are present and is the pure-Python
build elsewhere, as aiohttp, yarl and multidict fall back to theirs. Unset (the default) the
``.py`` files are the build: measured on the bench machine, the compiled modules ran 3.8 %
fewer instructions per PD request but took 10-28 % more CPU (bench/RESULTS.md, issue #39), so
the faster build is the default. An editable install (``pip install -e``, where a stale
extension would hide an edited source) compiles only with ``SIDECAR_COMPILE=1``. (Not
``DISAGG_*`` names: that prefix is the settings', and the sidecar warns about a variable it
does not know.)

Deliberate limits: the extensions are CPython-version specific (the wheel is too, whether or
not it compiled); the Cython directives keep Python's semantics (annotations are not enforced
as C types, so the test suites' fakes pass where the annotation names a class).
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


def _compile_mode() -> str:
    """``SIDECAR_COMPILE``: "" (the pure-Python build), "auto" or "1" (compile or fail)."""
    value = os.environ.get("SIDECAR_COMPILE", "").strip().lower()
    return "" if value in ("", "0") else "auto" if value == "auto" else "1"


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
    runs (never when pip only asks for the build's metadata); with ``SIDECAR_COMPILE=auto`` it
    leaves the pure-Python build in place when that or a compile fails."""

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
        if _compile_mode() != "auto":
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
    mode = _compile_mode()
    if not mode or (_editable() and mode != "1"):
        return []
    # Cython's generated C leaves helpers unused: not worth a warning per module.
    flags = [] if sys.platform == "win32" else ["-Wno-unused-function"]
    return [Extension(name, [name.replace(".", "/") + ".py"], extra_compile_args=flags)
            for name in _hot_modules()]


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
