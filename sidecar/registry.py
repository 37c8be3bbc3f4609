"""Lazy name -> "module:Class" registries, the one source of truth for pluggable parts.

Engine handlers and KV transfer agents are registered by wire name and imported on first use.
A duplicate name raises; an unknown name raises and lists the known ones; ``names()`` feeds
validation, CLI help and docs, so they cannot disagree.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any, Generic, TypeVar, cast

T = TypeVar("T")


class UnknownName(KeyError):
    """A name that is not registered; the message lists the valid names."""

    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        super().__init__(name)
        self.kind = kind
        self.name = name
        self.known = known

    def __str__(self) -> str:
        return f"unknown {self.kind} {self.name!r}; valid: {', '.join(self.known)}"


class LazyRegistry(Generic[T]):
    """Maps names to classes given as "module:Class", instantiated once on first use."""

    def __init__(self, kind: str, base: type[Any]) -> None:
        self._kind = kind
        self._base = base
        self._paths: dict[str, str] = {}
        self._instances: dict[str, T] = {}

    def register(self, name: str, path: str) -> None:
        key = name.lower()
        if key in self._paths:
            raise ValueError(f"{self._kind} {name!r} is already registered")
        self._paths[key] = path

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._paths)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._paths

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def get(self, name: str) -> T:
        """The instance registered under ``name`` (case-insensitive)."""
        key = name.lower()
        if key not in self._paths:
            raise UnknownName(self._kind, name, self.names())
        instance = self._instances.get(key)
        if instance is None:
            module_name, _, class_name = self._paths[key].partition(":")
            cls = getattr(importlib.import_module(module_name), class_name)
            if not (isinstance(cls, type) and issubclass(cls, self._base)):
                raise TypeError(f"{self._paths[key]} is not a {self._base.__name__}")
            instance = cast(T, cls())
            self._instances[key] = instance
        return instance
