"""The KV-events settings: where the local engine publishes what it caches, and the index's cap.

Part of ``sidecar.config.settings.Settings``. Unset ``kv_events_endpoint`` (the default): no
socket, no index, the placement decision never learns what is cached. Each value is checked
alone here (an endpoint's shape); whether a TCP address off loopback is allowed, and which
other settings it cannot go with, the loader's ``checks.check_kv_events`` decides (it knows
each value's source). How it works: docs/cache-aware.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sidecar.dialects.base import PodSource
from sidecar.kv_events.endpoint import check_endpoint

#: The default cap of the index, in blocks (about 45 MB at 16 tokens a block, 160 MB at 128: see
#: docs/cache-aware.md#the-cap).
DEFAULT_MAX_BLOCKS: Final = 131_072

#: The pod annotations that can set the endpoints.
KV_EVENTS_POD_SOURCES: Final[Mapping[str, PodSource]] = MappingProxyType({
    "kv_events_endpoint": PodSource("annotation", "kv_events_endpoint_annotation"),
    "kv_events_replay_endpoint": PodSource("annotation",
                                           "kv_events_replay_endpoint_annotation"),
})


class KVEventsSettings(BaseModel):
    """The local engine's KV events and the index they feed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kv_events_endpoint: str | None = Field(
        default=None,
        description="Where the local engine publishes its KV cache events (ZMQ): "
        "tcp://IP:PORT (the sidecar binds it and the engine's publisher connects; loopback "
        "unless --kv-events-allow-remote) or ipc://PATH (the engine binds, the sidecar "
        "connects). Feeds the index of the engine's cached prompt blocks (docs/cache-aware.md). "
        "Unset: no index. One worker only.",
    )
    kv_events_replay_endpoint: str | None = Field(
        default=None,
        description="The engine's replay socket (its replay_endpoint: tcp://IP:PORT or "
        "ipc://PATH, the sidecar connects): missed event batches are asked for there. Unset: a "
        "gap in the batches' numbering makes the index forget everything.",
    )
    kv_events_topic: str | None = Field(
        default=None,
        description="The engine publisher's topic (its topic setting); unset: every message "
        "on the endpoint.",
    )
    kv_events_allow_remote: bool = Field(
        default=False,
        description="Accept KV-event endpoints off loopback (the events carry prompt token "
        "ids: use only on a trusted network).",
    )
    kv_events_max_blocks: int = Field(
        default=DEFAULT_MAX_BLOCKS,
        ge=1,
        description="The most blocks the index holds; at the cap, storing one forgets the "
        "block stored longest ago (the index then finds fewer cached tokens than the engine "
        "holds, never more). Set it to the engine's KV-cache blocks or more.",
    )
    kv_events_endpoint_annotation: str = Field(
        default="model.aibrix.ai/kv-events-endpoint",
        min_length=1,
        description="Annotation holding --kv-events-endpoint.",
    )
    kv_events_replay_endpoint_annotation: str = Field(
        default="model.aibrix.ai/kv-events-replay-endpoint",
        min_length=1,
        description="Annotation holding --kv-events-replay-endpoint.",
    )

    @field_validator("kv_events_endpoint", "kv_events_replay_endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        # The shape only: loopback or not is checked with --kv-events-allow-remote in view.
        return None if value is None else check_endpoint(value, allow_remote=True)
