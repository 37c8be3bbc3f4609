"""Test-only start-up hooks for the ENGINE venv: a ``sitecustomize`` that loads them, and the
patching of an engine module right after it loads, which they share.

A hook is a module of this directory with a function ``patches()`` that returns, for each
module name, what to do to that module once it has loaded (nothing where the hook's
environment variable is unset): ``nixl_hook.py`` (every engine: NIXL fitted to a small CPU
machine), ``kv_event_timing_hook.py`` (measuring), ``pace_hook.py`` (a floor under an engine
step's time). ``load_hooks(paths)`` loads hook files by their paths and installs a meta-path
finder that hands each named module to its patch right after it executes, before anything
uses it. Two ways in:

- setup_env.sh copies this module (as ``disagg_engine_site``) and the NIXL hook into the
  engine venv, with a ``.pth`` line that loads the hook at every interpreter start there;
- ``install_dir(directory, hook, ...)`` writes a ``sitecustomize`` into ``directory``: an
  engine whose ``PYTHONPATH`` names it (``EngineSpec.extra_env``) loads this module and the
  hooks by their paths at start-up (the suite's directory never goes on the engine's
  ``sys.path``), a finder of their own beside the NIXL hook's.

The engine core is a child process of the API server: it inherits the environment and loads
the hooks too.

Deliberate limits: a module imported before the hooks load (the standard library's start-up
modules) cannot be patched; one patch per module name (within one ``load_hooks`` a later
hook's replaces an earlier one's; across the two ways in, the first finder's wins).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType

Patch = Callable[[ModuleType], None]

#: The name this module takes in the engine (loaded by its path, not as ``real_vllm.…``).
ENGINE_NAME = "disagg_engine_site"
_SITECUSTOMIZE = """\
import importlib.util
_spec = importlib.util.spec_from_file_location({name!r}, {site!r})
_site = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_site)
_site.load_hooks({hooks!r})
"""


def install_dir(directory: Path, *hooks: ModuleType) -> Path:
    """Write a ``sitecustomize`` that loads ``hooks`` (modules of this directory) into
    ``directory``; the directory, for the engine's ``PYTHONPATH``."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = [str(Path(str(hook.__file__)).resolve()) for hook in hooks]
    (directory / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(
        name=ENGINE_NAME, site=str(Path(__file__).resolve()), hooks=paths))
    return directory


#: Hook files this module has loaded: a venv's ``.pth`` line can run twice in one start-up
#: (the import in it only once), and a hook's patches must be installed once.
_loaded: set[str] = set()


def load_hooks(paths: Iterable[str]) -> None:
    """Load each hook file and install its patches (in the engine, from ``sitecustomize``)."""
    patches: dict[str, Patch] = {}
    for path in paths:
        if path in _loaded:
            continue
        _loaded.add(path)
        stem = Path(path).stem  # the NIXL hook's copy is already disagg_nixl_hook
        name = stem if stem.startswith("disagg_") else f"disagg_{stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None, path
        hook = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(hook)
        patches.update(hook.patches())
    if patches:  # each way in calls this once per interpreter start
        sys.meta_path.insert(0, _Finder(patches))


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch: Patch) -> None:
        self._inner = inner
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    #: Marks the finders of every copy of this module (the ``.pth``'s and a
    #: ``sitecustomize``'s are two): each looks past all of them for the real spec, or two
    #: finders of one name would ask each other without end.
    disagg_patching = True

    def __init__(self, patches: Mapping[str, Patch]) -> None:
        self._patches = patches

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        patch = self._patches.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if getattr(finder, "disagg_patching", False) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None
