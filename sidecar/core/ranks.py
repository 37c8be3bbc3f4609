"""The data-parallel ranks the PD flow gives its legs (``--data-parallel-size``,
``--prefill-data-parallel-size``; docs/operating/data-parallel.md).

    ranks.prefill(target, named)   the prefill leg's rank on ``target``'s engine
    ranks.local(named)             a leg's rank on the local engine (decode, gRPC Prefill)
    ranks.hold(rank) / release     a decode leg is busy on its local rank until its request ends
    ranks.held(exits, named)       a gRPC Decode's local rank, busy until ``exits`` closes

Each is the router's ``named`` rank when it gave one, else the least busy
(``TargetChoice.pick_rank``), and None when that engine has one rank: no leg then carries a
rank. Only the dialect knows where a rank goes (header, body field, looked-up id).
"""

from __future__ import annotations

import contextlib

from sidecar.protocol.context import PrefillTarget
from sidecar.targets.choice import LOCAL, TargetChoice


class LegRanks:
    """Rank choice for one flow: the sizes of its engines over the process's choice."""

    def __init__(self, choice: TargetChoice, *, local_size: int = 1,
                 prefill_size: int = 1) -> None:
        self.choice = choice
        self.local_size = local_size
        self.prefill_size = prefill_size

    def prefill(self, target: PrefillTarget, named: int | None = None) -> int | None:
        if self.prefill_size <= 1:
            return None
        return named if named is not None else self.choice.pick_rank(target, self.prefill_size)

    def local(self, named: int | None = None) -> int | None:
        if self.local_size <= 1:
            return None
        return named if named is not None else self.choice.pick_rank(LOCAL, self.local_size)

    def hold(self, rank: int | None) -> None:
        if rank is not None:
            self.choice.hold_rank(LOCAL, rank)

    def release(self, rank: int | None) -> None:
        if rank is not None:
            self.choice.release_rank(LOCAL, rank)

    def held(self, exits: contextlib.ExitStack | contextlib.AsyncExitStack,
             named: int | None = None) -> int | None:
        rank = self.local(named)
        if rank is not None:
            self.hold(rank)
            exits.callback(self.release, rank)
        return rank
