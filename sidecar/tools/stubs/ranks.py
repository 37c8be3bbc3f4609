"""A stub engine's data-parallel ranks: where each request runs, and what each rank served.

    StubConfig(data_parallel_size=N)   N ranks behind one API server (internal load balancing)
    ranks.place(named)                 the named rank, else the next in turn (the engine's
                                       own balancing)
    ranks.engine_id(base, rank)        vLLM's KV identity of a rank: "<base>_dp<rank>" (N > 1)
    ranks.served[(path, rank)]         requests each rank served, by path (what tests read)
    ranks.metric_lines()               per-rank counters, as vLLM's ``engine="<rank>"`` ones

How the engines read a named rank (docs in docs/operating/data-parallel.md):

- vLLM 0.32.0 (``entrypoints/generate/base/serving.py``, ``v1/engine/input_processor.py``):
  header ``X-data-parallel-rank``, ``int(value)``; a malformed value is ignored (balanced);
  outside ``[0, N)`` a 400 "data_parallel_rank R is out of range [0, N).".
- SGLang 0.5.23 (``managers/tokenizer_manager.py``): body ``routed_dp_rank``; outside
  ``[0, N)`` a ValueError (400); with one rank a 0 is ignored.

Deliberate limits: ranks share one process and one KV store (what differs per rank is the
identity a hand-off names, which is what a wrong rank breaks); no per-rank queues or timing.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any, Final

from sidecar.tools.stubs.openai import BadRequest

VLLM_RANK_HEADER: Final = "X-data-parallel-rank"


class Ranks:
    """One stub engine's ranks."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("data_parallel_size must be >= 1")
        self.size = size
        self.served: Counter[tuple[str, int]] = Counter()
        self._turns = itertools.count()

    def place(self, named: int | None, path: str) -> int:
        """The rank a request runs on (``named``, else the next in turn), counted."""
        rank = named if named is not None else next(self._turns) % self.size
        self.served[(path, rank)] += 1
        return rank

    def on(self, rank: int) -> int:
        """Requests served by ``rank``, on every path."""
        return sum(count for (_, served), count in self.served.items() if served == rank)

    def engine_id(self, base: str, rank: int) -> str:
        """The KV identity of ``rank`` (vLLM suffixes it per rank when there are several)."""
        return base if self.size == 1 else f"{base}_dp{rank}"

    def vllm_named(self, header: str | None) -> int | None:
        """The rank a vLLM request's header names (None: none, or malformed and ignored)."""
        if header is None:
            return None
        try:
            rank = int(header)
        except ValueError:
            return None  # vLLM ignores what it cannot read: the request is balanced
        if not 0 <= rank < self.size:
            raise BadRequest(f"data_parallel_rank {rank} is out of range [0, {self.size}).")
        return rank

    def sglang_named(self, value: Any) -> int | None:
        """The rank a SGLang body's ``routed_dp_rank`` names (None: none)."""
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadRequest("routed_dp_rank must be an integer")
        if self.size == 1 and value == 0:
            return None
        if not 0 <= value < self.size:
            raise BadRequest(f"routed_dp_rank={value} out of range [0, {self.size})")
        return value

    def metric_lines(self, name: str, model: str) -> list[str]:
        """``name{engine="<rank>",model_name=...}``: requests each rank served."""
        return [f"# TYPE {name} counter"] + [
            f'{name}{{engine="{rank}",model_name="{model}"}} {self.on(rank)}'
            for rank in range(self.size)
        ]
