"""KV transfer agents by wire name (the pod label ``model.aibrix.ai/kv-connector-type``).

Resolution follows the seed: ``resolve_agent`` raises for an unknown name and lists the valid
ones; ``resolve_connector_type`` (for label values) falls back to the configured default.
"""

from __future__ import annotations

from sidecar.kv_agents.base import KVTransferAgent
from sidecar.registry import LazyRegistry, UnknownName

DEFAULT_CONNECTOR = "shfs"

AGENTS: LazyRegistry[KVTransferAgent] = LazyRegistry("kv connector", KVTransferAgent)
AGENTS.register("mooncake", "sidecar.kv_agents.mooncake:MooncakeAgent")
AGENTS.register("nixl", "sidecar.kv_agents.nixl:NeuronNixlAgent")
AGENTS.register("shfs", "sidecar.kv_agents.shfs:NixlPullAgent")


def resolve_agent(name: str) -> KVTransferAgent:
    """The agent registered as ``name`` (case-insensitive); ``UnknownName`` otherwise."""
    return AGENTS.get(name)


def resolve_connector_type(label_value: str | None, global_default: str) -> tuple[str, bool]:
    """The effective connector for a label value, and whether the label was used as given.

    A missing or unrecognized label falls back to ``global_default`` (the seed's rule);
    the caller warns once when the second element is False and a label was present.
    """
    if label_value is not None and label_value.strip().lower() in AGENTS:
        return label_value.strip().lower(), True
    return global_default, False


def valid_agent_names() -> list[str]:
    """Registered connector names, sorted."""
    return AGENTS.names()


__all__ = [
    "AGENTS",
    "DEFAULT_CONNECTOR",
    "KVTransferAgent",
    "UnknownName",
    "resolve_agent",
    "resolve_connector_type",
    "valid_agent_names",
]
