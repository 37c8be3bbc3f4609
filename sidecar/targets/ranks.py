"""Data-parallel ranks, in one place: which rank of an engine each leg runs on.

    parse_rank_header(values, size)      the router's ``x-data-parallel-rank`` (HTTP header)
    rank_from_metadata(metadata, size)   the same, as gRPC metadata (the local engine's rank)
    RankChoice                           rank load and cool-downs per engine (the local one,
                                         ``LOCAL``, or a prefill target), for the whole process
        .pick_rank(engine, size)         ─▶ the rank with the fewest legs in flight from this
                                            sidecar (ties: the next in turn), skipping ranks
                                            whose legs failed within the cool-down; None when
                                            the engine has one rank
        with .rank_leg(engine, rank):    counts a leg in flight on that rank
        .rank_failed / .rank_answered    a leg's outcome: cool the rank down / end it
    LegRanks                             one flow's engines' sizes over the ``RankChoice``:
        .prefill(target, named)          the prefill leg's rank on ``target``'s engine
        .local(named)                    a leg's rank on the local engine (decode, gRPC Prefill)
        .hold(rank) / .release(rank)     a decode leg is busy on its local rank until it ends
        .held(exits, named)              a gRPC Decode's local rank, busy until ``exits`` closes

Each is the router's ``named`` rank when it gave one, else the least busy, and None when that
engine has one rank: no leg then carries a rank. Only the dialect knows where a rank goes
(header, body field, looked-up id); the placement decision (``sidecar.request.placement``) asks
``LegRanks`` for a pair's ranks.

The router's rank is parsed strictly like every routing header: one value, ASCII decimal
digits only (no sign, space or leading zero), below the engines' data-parallel size; anything
else is refused (400 / INVALID_ARGUMENT). It names the prefill leg's rank over HTTP and the
local engine's over gRPC, and is never forwarded to an engine.

Deliberate limits: this process's own view (each ``--workers`` worker its own); ties between
ranks go to the next in turn, so a sidecar whose legs never overlap still uses every rank.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Final

from sidecar.bounded import CoolDowns
from sidecar.errors import InvalidRequest
from sidecar.protocol.context import PrefillTarget

RANK_HEADER: Final = "x-data-parallel-rank"
#: Longer than any rank below the size bound (1024): refused before it is read as a number.
_MAX_DIGITS: Final = 4
#: Engines whose rank turn is remembered (cleared whole when full: bounded memory; a router's
#: header may name many targets).
_MAX_TURNS: Final = 4096
#: The local engine, as the engine of a rank (a prefill target names a remote one).
LOCAL: Final = None
#: An engine whose ranks are chosen: a prefill target, or ``LOCAL``.
Engine = PrefillTarget | None


def parse_rank(text: str, size: int, *, name: str = RANK_HEADER) -> int:
    """One rank written as ``text``, checked against ``size`` ranks."""
    if not (0 < len(text) <= _MAX_DIGITS and text.isascii() and text.isdigit()):
        raise InvalidRequest(f"{name}: expected a rank in 0..{size - 1}")
    if len(text) > 1 and text[0] == "0":
        raise InvalidRequest(f"{name}: a rank has no leading zero")
    rank = int(text)
    if rank >= size:
        raise InvalidRequest(
            f"{name}: rank {rank} is out of range; the prefill engines have {size} "
            f"data-parallel rank{'s' if size != 1 else ''} (0..{size - 1})"
        )
    return rank


def parse_rank_header(values: Sequence[str], size: int) -> int | None:
    """The rank a request's ``x-data-parallel-rank`` header names, or None without one.

    Engines with one rank (``size`` 1): the header may name only 0, and names nothing (no
    leg ever carries a rank then).
    """
    if not values:
        return None
    if len(values) > 1:
        raise InvalidRequest(f"{RANK_HEADER}: given more than once")
    rank = parse_rank(values[0], size)
    return rank if size > 1 else None


def rank_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None,
                       size: int) -> int | None:
    """The local rank a gRPC call's ``x-data-parallel-rank`` metadata names (None: none, or
    the engine has one rank)."""
    values = [value if isinstance(value, str) else value.decode("latin-1")
              for key, value in metadata or () if key == RANK_HEADER]
    return parse_rank_header(values, size)


class RankChoice:
    """Least-in-flight choice of data-parallel ranks per engine, with a cool-down for ranks
    whose legs failed."""

    def __init__(self, *, cooldown_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._rank_in_flight: dict[tuple[Engine, int], int] = {}
        self._rank_cooling: CoolDowns[tuple[Engine, int]] = CoolDowns(cooldown_s, clock)
        self._rank_turns: dict[Engine, int] = {}

    def rank_in_flight(self, engine: Engine, rank: int) -> int:
        return self._rank_in_flight.get((engine, rank), 0)

    def rank_cooling(self, engine: Engine, rank: int) -> bool:
        return self._rank_cooling.active((engine, rank))

    def pick_rank(self, engine: Engine, size: int) -> int | None:
        """The rank of ``engine`` (``size`` ranks) for its next leg; None when ``size`` is 1.

        Fewest legs in flight first, skipping ranks cooling down (unless all are); of equal
        ones the first from a turn that moves on with every pick.
        """
        if size <= 1:
            return None
        start = self._turn(engine, size)
        best = self._least_loaded(engine, size, start, skip_cooling=True)
        if best is None:  # every rank is cooling down: one is still picked
            best = self._least_loaded(engine, size, start, skip_cooling=False)
        assert best is not None
        return best

    def _turn(self, engine: Engine, size: int) -> int:
        """Where ``engine``'s next pick starts looking: one rank on from its last."""
        turns = self._rank_turns
        turn = turns.get(engine, 0)
        if len(turns) >= _MAX_TURNS and engine not in turns:
            turns.clear()
        turns[engine] = (turn + 1) % size
        return turn

    def _least_loaded(self, engine: Engine, size: int, start: int, *,
                      skip_cooling: bool) -> int | None:
        best: int | None = None
        best_load = 0
        for offset in range(size):
            rank = (start + offset) % size
            if skip_cooling and self.rank_cooling(engine, rank):
                continue
            load = self._rank_in_flight.get((engine, rank), 0)
            if best is None or load < best_load:
                best, best_load = rank, load
                if load == 0:
                    break  # none can have fewer
        return best

    def hold_rank(self, engine: Engine, rank: int) -> None:
        """Count one leg in flight on ``rank`` of ``engine`` (until ``release_rank``)."""
        key = (engine, rank)
        self._rank_in_flight[key] = self._rank_in_flight.get(key, 0) + 1

    def release_rank(self, engine: Engine, rank: int) -> None:
        key = (engine, rank)
        left = self._rank_in_flight[key] - 1
        if left:
            self._rank_in_flight[key] = left
        else:
            del self._rank_in_flight[key]

    @contextlib.contextmanager
    def rank_leg(self, engine: Engine, rank: int) -> Iterator[None]:
        """Count one leg in flight on ``rank`` of ``engine`` while the block runs."""
        self.hold_rank(engine, rank)
        try:
            yield
        finally:
            self.release_rank(engine, rank)

    def rank_answered(self, engine: Engine, rank: int) -> None:
        """A leg on ``rank`` of ``engine`` succeeded: whatever failure it had is over."""
        self._rank_cooling.end((engine, rank))

    def rank_failed(self, engine: Engine, rank: int) -> None:
        """A leg on ``rank`` of ``engine`` failed: skip the rank for the cool-down."""
        self._rank_cooling.start((engine, rank))


class LegRanks:
    """Rank choice for one flow: the sizes of its engines over the process's ``RankChoice``."""

    def __init__(self, choice: RankChoice, *, local_size: int = 1,
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
