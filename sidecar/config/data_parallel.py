"""The data-parallel settings: how many ranks the local engine and the prefill engines hold.

Part of ``sidecar.config.settings.Settings``. A wide expert-parallel deployment runs one engine
pod with several data-parallel ranks, each with its own KV cache and KV-transfer agent; the
sidecar chooses a rank for each leg (``sidecar.targets.choice``) and its dialect puts it where
the engine reads it. Size 1 (the default) means no rank is ever named: bodies and headers are
what they are without data parallelism.

``prefill_data_parallel_size`` defaults to ``data_parallel_size`` (the same engine build on
both sides is the common deployment); the loader names that source.

Deliberate limits: every prefill target has the same size (a router that mixes sizes names
the rank itself); the bound keeps the per-rank metric labels few.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sidecar.dialects.base import PodSource

#: The most ranks one engine may have here (wide-EP pods hold tens; the metric label is bounded
#: by the configured size, and this bounds the size).
MAX_DATA_PARALLEL_SIZE: Final = 1024

#: The pod labels that can set the sizes (read as text; the field checks the number).
DATA_PARALLEL_POD_SOURCES: Final[Mapping[str, PodSource]] = MappingProxyType({
    "data_parallel_size": PodSource("label", "data_parallel_size_label"),
    "prefill_data_parallel_size": PodSource("label", "prefill_data_parallel_size_label"),
})


class DataParallelSettings(BaseModel):
    """The ranks of the local engine and of the prefill engines."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    data_parallel_size: int = Field(
        default=1,
        ge=1,
        le=MAX_DATA_PARALLEL_SIZE,
        description="Data-parallel ranks of the local engine (its data-parallel size, one "
        "API server for all ranks); above 1 each leg on it is given a rank (see "
        "docs/operating/data-parallel.md). 1: no rank is ever named.",
    )
    prefill_data_parallel_size: int | None = Field(
        default=None,
        ge=1,
        le=MAX_DATA_PARALLEL_SIZE,
        description="Data-parallel ranks of each prefill engine this sidecar sends prefill "
        "legs to; unset: --data-parallel-size.",
    )
    data_parallel_size_label: str = Field(
        default="model.aibrix.ai/data-parallel-size",
        min_length=1,
        description="Label holding the local engine's data-parallel size.",
    )
    prefill_data_parallel_size_label: str = Field(
        default="model.aibrix.ai/prefill-data-parallel-size",
        min_length=1,
        description="Label holding the prefill engines' data-parallel size.",
    )

    @model_validator(mode="before")
    @classmethod
    def _prefill_follows_local(cls, values: Any) -> Any:
        # Unset (or None): the same as the local engine's.
        if isinstance(values, dict) and values.get("prefill_data_parallel_size") is None:
            values = {**values,
                      "prefill_data_parallel_size": values.get("data_parallel_size", 1)}
        return values
