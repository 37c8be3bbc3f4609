"""Proves the dialect registry follows the resolution rules (docs/driving/handoffs.md#resolution)
and loads
what it lists.

Every registered (engine, connector) loads a ``Dialect`` declaring exactly that engine and
connector; an unknown engine resolves to the default dialect, an engine with connectors to
its connector's (the default one when none is named); an unknown connector raises and lists
the sorted valid names; a duplicate registration raises; a path that is not a dialect, or one
whose declared names differ from its key, is refused by name; every dialect option has a
description and every pod source names a real field.
"""

from __future__ import annotations

import pytest

from sidecar.dialects import DIALECTS, FALLBACK_ENGINE, Dialect, dialect_class
from sidecar.dialects.default import DefaultDialect
from sidecar.dialects.registry import DialectLoadError, DialectRegistry, UnknownName


def test_engine_and_connector_names() -> None:
    assert DIALECTS.engines() == ["default", "sglang", "trtllm", "vllm"]
    assert DIALECTS.connectors() == ["mooncake", "nixl", "nixl-push", "shfs"]
    assert DIALECTS.engines_of("mooncake") == ["vllm"]


@pytest.mark.parametrize(("engine", "connector"), DIALECTS.keys())
def test_every_dialect_loads_as_registered(engine: str, connector: str | None) -> None:
    cls = DIALECTS.get(engine, connector)
    assert issubclass(cls, Dialect)
    assert (cls.engine, cls.connector) == (engine, connector)
    assert cls.handoff_keys or cls is DefaultDialect  # only the default hands nothing off


@pytest.mark.parametrize("name", ["tgi", "", "llama.cpp"])
def test_unknown_engine_resolves_to_default(name: str) -> None:
    assert dialect_class(name, None) is DefaultDialect
    assert dialect_class(name, None).engine == FALLBACK_ENGINE


def test_lookup_is_case_insensitive_and_cached() -> None:
    assert DIALECTS.get("SGLang") is DIALECTS.get("sglang")
    assert DIALECTS.get("vllm", "MoonCake") is DIALECTS.get("vllm", "mooncake")


def test_unknown_connector_lists_sorted_valid_names() -> None:
    with pytest.raises(UnknownName) as info:
        dialect_class("vllm", "lmcache")
    assert str(info.value) == (
        "unknown kv connector 'lmcache'; valid: mooncake, nixl, nixl-push, shfs")
    assert info.value.known == ["mooncake", "nixl", "nixl-push", "shfs"]


def test_duplicate_registration_raises() -> None:
    registry = DialectRegistry()
    registry.register("x", "sidecar.dialects.default:DefaultDialect")
    with pytest.raises(DialectLoadError, match="already registered"):
        registry.register("X", "sidecar.dialects.sglang:SGLangDialect")
    with pytest.raises(DialectLoadError):
        DIALECTS.register("vllm.shfs", "sidecar.dialects.vllm_nixl:NixlPullDialect")


@pytest.mark.parametrize(("name", "path", "why"), [
    ("bad", "sidecar.config.settings:Settings", "not a Dialect subclass"),
    ("bad", "sidecar.dialects.nowhere:X", "does not load"),
    ("bad", "sidecar.dialects.default:Nothing", "does not load"),
    ("sglang2", "sidecar.dialects.sglang:SGLangDialect", "declares engine 'sglang'"),
])
def test_registered_path_that_is_no_such_dialect_is_refused(name: str, path: str,
                                                            why: str) -> None:
    registry = DialectRegistry()
    registry.register(name, path)
    with pytest.raises(DialectLoadError, match=why):
        registry.get(name)


def test_dialect_options_are_documented_settings() -> None:
    for model in DIALECTS.option_models():
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no description"
        for name, source in model.pod_sources.items():
            assert name in model.model_fields and source.key_field in model.model_fields
