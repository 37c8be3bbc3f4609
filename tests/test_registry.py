"""Proves the engine and KV-connector registries follow the seed's resolution rules.

Every registered name loads its class (named as registered, with checked_against filled);
an unknown engine resolves to the default handler; an unknown connector raises and lists the
sorted valid names; label resolution falls back to the configured default; a duplicate
registration raises; lookups are case-insensitive and instances are cached.
"""

from __future__ import annotations

import pytest

from sidecar.engines import ENGINES, resolve_engine, valid_engine_names
from sidecar.engines.base import EngineHandler
from sidecar.engines.default import DefaultHandler
from sidecar.kv_agents import (
    AGENTS,
    UnknownName,
    resolve_agent,
    resolve_connector_type,
    valid_agent_names,
)
from sidecar.kv_agents.base import KVTransferAgent
from sidecar.registry import LazyRegistry


def test_engine_names() -> None:
    assert valid_engine_names() == ["default", "sglang", "trtllm", "vllm"]


def test_agent_names() -> None:
    assert valid_agent_names() == ["mooncake", "nixl", "shfs"]


@pytest.mark.parametrize("name", ["default", "sglang", "trtllm", "vllm"])
def test_every_engine_loads(name: str) -> None:
    handler = resolve_engine(name)
    assert isinstance(handler, EngineHandler)
    assert handler.name == name
    assert handler.checked_against


@pytest.mark.parametrize("name", ["mooncake", "nixl", "shfs"])
def test_every_agent_loads(name: str) -> None:
    agent = resolve_agent(name)
    assert isinstance(agent, KVTransferAgent)
    assert agent.name == name
    assert agent.checked_against
    assert agent.engines == frozenset({"vllm"})


def test_only_vllm_uses_agents() -> None:
    assert [n for n in valid_engine_names() if resolve_engine(n).uses_kv_agent] == ["vllm"]


@pytest.mark.parametrize("name", ["tgi", "", "llama.cpp"])
def test_unknown_engine_resolves_to_default(name: str) -> None:
    assert isinstance(resolve_engine(name), DefaultHandler)


def test_engine_lookup_is_case_insensitive_and_cached() -> None:
    assert resolve_engine("SGLang") is resolve_engine("sglang")


def test_unknown_connector_lists_sorted_valid_names() -> None:
    with pytest.raises(UnknownName) as info:
        resolve_agent("lmcache")
    assert str(info.value) == "unknown kv connector 'lmcache'; valid: mooncake, nixl, shfs"
    assert info.value.known == ["mooncake", "nixl", "shfs"]


def test_connector_lookup_is_case_insensitive() -> None:
    assert resolve_agent("MoonCake") is resolve_agent("mooncake")


@pytest.mark.parametrize(
    ("label", "expected"),
    [
        ("nixl", ("nixl", True)),
        (" Mooncake ", ("mooncake", True)),
        ("SHFS", ("shfs", True)),
        ("p2pnccl", ("shfs", False)),
        (None, ("shfs", False)),
        ("", ("shfs", False)),
    ],
)
def test_label_resolution(label: str | None, expected: tuple[str, bool]) -> None:
    assert resolve_connector_type(label, "shfs") == expected


def test_duplicate_registration_raises() -> None:
    registry: LazyRegistry[EngineHandler] = LazyRegistry("engine", EngineHandler)
    registry.register("x", "sidecar.engines.default:DefaultHandler")
    with pytest.raises(ValueError, match="already registered"):
        registry.register("X", "sidecar.engines.vllm:VLLMHandler")


def test_duplicate_registration_on_the_real_registries_raises() -> None:
    with pytest.raises(ValueError):
        ENGINES.register("vllm", "sidecar.engines.vllm:VLLMHandler")
    with pytest.raises(ValueError):
        AGENTS.register("shfs", "sidecar.kv_agents.shfs:NixlPullAgent")


def test_registered_path_of_wrong_kind_raises() -> None:
    registry: LazyRegistry[KVTransferAgent] = LazyRegistry("kv connector", KVTransferAgent)
    registry.register("bad", "sidecar.engines.default:DefaultHandler")
    with pytest.raises(TypeError):
        registry.get("bad")
