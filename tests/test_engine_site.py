"""The engine venv's start-up hooks load (tests/real_vllm/engine_site.py), checked without
vLLM: a stand-in ``vllm.v1.engine.core`` in a temporary directory, a Python process started
as the harness starts an engine (the ``sitecustomize`` directory on ``PYTHONPATH``).

Proves: with the hook's variable set, the module is patched right after it loads, before
its importer uses it (``EngineCore.step`` is the pace hook's); without it, nothing is
touched; a second copy of the loader with the same hook (loaded twice) neither patches again
nor recurses. The ``.pth`` way in (setup_env.sh) and the real engine's modules are the real-vLLM
suite's (test_engines_direct.py sees the NIXL hook's lines, test_migration.py the pace).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from real_vllm import engine_site, pace_hook

_STAND_IN = '''\
class EngineCore:
    def step(self):
        return {}, True
'''
_WHERE_STEP_LIVES = ("import vllm.v1.engine.core as core; "
                     "print(core.EngineCore.step.__code__.co_filename)")


#: A second copy of engine_site (as the ``.pth``'s import is beside a ``sitecustomize``'s)
#: loading the same hook again: two finders for one module name.
_TWIN = ("import importlib.util, sys; "
         "spec = importlib.util.spec_from_file_location('twin', sys.argv[1]); "
         "twin = importlib.util.module_from_spec(spec); spec.loader.exec_module(twin); "
         "twin.load_hooks([sys.argv[2]]); twin.load_hooks([sys.argv[2]]); ")


def _step_defined_in(tmp_path: Path, *, twin: bool = False, **env: str) -> str:
    package = tmp_path / "engine"
    for name in ("vllm", "v1", "engine"):  # regular packages: an installed vllm never wins
        package /= name
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("")
    (package / "core.py").write_text(_STAND_IN)
    site = engine_site.install_dir(tmp_path / "site", pace_hook)
    code = (_TWIN if twin else "") + _WHERE_STEP_LIVES
    done = subprocess.run(
        [sys.executable, "-c", code, engine_site.__file__, pace_hook.__file__],
        env={**{k: v for k, v in os.environ.items() if k != pace_hook.ENV_VAR},
             "PYTHONPATH": f"{site}{os.pathsep}{tmp_path / 'engine'}", **env},
        capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_hook_patches_its_module_as_it_loads(tmp_path: Path) -> None:
    defined_in = Path(_step_defined_in(tmp_path, **{pace_hook.ENV_VAR: "0"}))
    assert defined_in.resolve() == Path(pace_hook.__file__).resolve()


def test_a_hook_without_its_variable_touches_nothing(tmp_path: Path) -> None:
    assert _step_defined_in(tmp_path).endswith("core.py")


def test_two_copies_of_the_loader_patch_once_and_do_not_ask_each_other(tmp_path: Path) -> None:
    """Each finder looks past every copy's finders (asking each other, two finders of one
    module name recursed until Python gave up: seen on the real engine venv)."""
    defined_in = Path(_step_defined_in(tmp_path, twin=True, **{pace_hook.ENV_VAR: "0"}))
    assert defined_in.resolve() == Path(pace_hook.__file__).resolve()
