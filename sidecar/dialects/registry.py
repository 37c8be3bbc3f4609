"""The dialect registry: (engine, connector) -> "module:Class", imported on first use.

Built-in dialects are registered by one line each (``sidecar.dialects``); an installed
package adds its own through the entry point group ``disagg_sidecar.dialects``
(docs/extending/writing-a-dialect.md), as vLLM loads out-of-tree connectors by module path: the
entry point
``acme`` names engine label "acme", ``vllm.lmcache`` engine vllm with connector "lmcache".

A name registered twice raises (a plug-in cannot silently replace a built-in); an entry
point that does not load, or loads something that is not a ``Dialect`` subclass whose
``engine`` and ``connector`` match its name, raises ``DialectLoadError`` naming it.
Deliberate limits: entry points are read once per process, at the first lookup.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from importlib.metadata import entry_points
from typing import Final

from sidecar.dialects.base import Dialect, DialectOptions

ENTRY_POINT_GROUP: Final = "disagg_sidecar.dialects"

#: (engine, connector) — connector None for engines that have no connectors.
DialectKey = tuple[str, str | None]


class UnknownName(KeyError):
    """A name that is not registered; the message lists the valid names."""

    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        super().__init__(name)
        self.kind = kind
        self.name = name
        self.known = known

    def __str__(self) -> str:
        return f"unknown {self.kind} {self.name!r}; valid: {', '.join(self.known)}"


class DialectLoadError(RuntimeError):
    """A registered dialect that cannot be loaded; the message names its entry."""


def _key_of(name: str) -> DialectKey:
    engine, _, connector = name.strip().lower().partition(".")
    return engine, connector or None


def _name_of(key: DialectKey) -> str:
    engine, connector = key
    return engine if connector is None else f"{engine}.{connector}"


class DialectRegistry:
    """Dialect classes by (engine, connector), built-in lines first, then entry points."""

    def __init__(self) -> None:
        self._paths: dict[DialectKey, str] = {}
        self._classes: dict[DialectKey, type[Dialect]] = {}
        self._plugins_read = False

    def register(self, name: str, path: str) -> None:
        """Register ``path`` ("module:Class") as ``name`` ("engine" or "engine.connector")."""
        key = _key_of(name)
        if key in self._paths:
            raise DialectLoadError(f"dialect {name!r} is already registered ({self._paths[key]})")
        self._paths[key] = path

    def _read_plugins(self) -> None:
        if self._plugins_read:
            return
        self._plugins_read = True
        for point in entry_points(group=ENTRY_POINT_GROUP):
            self.register(point.name, point.value)

    def keys(self) -> list[DialectKey]:
        self._read_plugins()
        return sorted(self._paths, key=lambda key: (key[0], key[1] or ""))

    def __iter__(self) -> Iterator[DialectKey]:
        return iter(self.keys())

    def engines(self) -> list[str]:
        """Registered engine names, sorted."""
        return sorted({engine for engine, _ in self.keys()})

    def connectors(self, engine: str | None = None) -> list[str]:
        """Connector names (of ``engine``, or of every engine), sorted."""
        return sorted({connector for name, connector in self.keys()
                       if connector is not None and engine in (None, name)})

    def connector_aliases(self) -> dict[str, str]:
        """Every declared connector alias, as its dialect spells it, -> its connector name
        (loads each connector dialect). An alias that is also another connector's name or
        alias raises ``DialectLoadError``."""
        aliases: dict[str, str] = {}
        seen: dict[str, str] = {name: name for name in self.connectors()}
        for engine, connector in self.keys():
            if connector is None:
                continue
            for alias in self.get(engine, connector).aliases:
                key = alias.strip().lower()
                if seen.setdefault(key, connector) != connector:
                    raise DialectLoadError(
                        f"connector alias {alias!r} of dialect '{engine}.{connector}' already "
                        f"names connector {seen[key]!r}"
                    )
                aliases[alias] = connector
        return aliases

    def connector_name(self, name: str) -> str:
        """``name`` as a registered connector name: lower-cased, an alias replaced by its
        connector (``NixlConnector`` -> ``shfs``); an unknown name is returned lower-cased."""
        key = name.strip().lower()
        if key in self.connectors():
            return key
        by_key = {alias.lower(): connector for alias, connector in self.connector_aliases().items()}
        return by_key.get(key, key)

    def engines_of(self, connector: str) -> list[str]:
        """The engines a connector name is registered for, sorted."""
        return sorted({engine for engine, name in self.keys() if name == connector})

    def has(self, engine: str, connector: str | None = None) -> bool:
        self._read_plugins()
        return (engine.lower(), connector.lower() if connector else None) in self._paths

    def get(self, engine: str, connector: str | None = None) -> type[Dialect]:
        """The dialect class of ``engine`` (and ``connector``); ``UnknownName`` otherwise."""
        self._read_plugins()
        key: DialectKey = (engine.lower(), connector.lower() if connector else None)
        cls = self._classes.get(key)
        if cls is not None:
            return cls
        path = self._paths.get(key)
        if path is None:
            kind, name = ("engine", engine) if connector is None else ("kv connector", connector)
            known = self.engines() if connector is None else self.connectors(engine)
            raise UnknownName(kind, name, known)
        cls = self._classes[key] = _load(_name_of(key), path, key)
        return cls

    def option_models(self) -> list[type[DialectOptions]]:
        """Every registered dialect's ``Options`` (each once), in registry order."""
        models: list[type[DialectOptions]] = []
        for engine, connector in self.keys():
            options = self.get(engine, connector).Options
            if options is not None and options not in models:
                models.append(options)
        return models


def _load(name: str, path: str, key: DialectKey) -> type[Dialect]:
    module_name, _, class_name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise DialectLoadError(f"dialect {name!r} ({path}) does not load: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, Dialect)):
        raise DialectLoadError(f"dialect {name!r} ({path}) is not a Dialect subclass")
    if (cls.engine, cls.connector) != key:
        raise DialectLoadError(
            f"dialect {name!r} ({path}) declares engine {cls.engine!r} and connector "
            f"{cls.connector!r}"
        )
    return cls
