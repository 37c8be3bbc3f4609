"""The local engine's prefix cache, known from its KV events (``--kv-events-endpoint``).

    engine publisher ──ZMQ──▶ subscriber ─decode (wire)─▶ EngineKVCache ─▶ PrefixIndex
                                                              ▲
                                placement decision ── CachedPrefix.cached_tokens(token_ids)

One concept per module: ``wire`` (the message format), ``index`` (blocks by parent and token
ids), ``sequence`` (in order, missed, restarted), ``engine_cache`` (the index kept honest and
counted), ``endpoint`` (which addresses, which socket side), ``subscriber`` (the sockets, the
replay, the task). How it works and how to set up the engines: docs/operating/cache-aware.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class CachedPrefix(Protocol):
    """What the placement decision asks about the local engine's prefix cache."""

    #: Tokens per block; None until the first BlockStored told it.
    block_size: int | None

    @property
    def answers(self) -> bool:
        """Whether ``cached_tokens`` can answer now (a prompt is tokenized for it only then)."""
        ...

    def cached_tokens(self, token_ids: Sequence[int]) -> int | None:
        """The longest prefix of ``token_ids`` the engine holds, in whole blocks, as tokens (a
        multiple of ``block_size``); None when the index cannot answer truthfully."""
        ...


__all__ = ["CachedPrefix"]
