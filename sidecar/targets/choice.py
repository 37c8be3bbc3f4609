"""Where a leg goes: which of several prefill targets gets a prefill leg, which rank of a
data-parallel engine each leg runs on, and which are cooling down; the prefill targets as
the placement decision sees them (``PrefillTargets``).

    TargetChoice.pick(candidates, exclude)  ─▶ the target with the fewest prefill legs in
                                               flight from this sidecar (ties at random;
                                               power of two random choices past 4 targets),
                                               skipping targets whose connect was refused
                                               within the cool-down and targets whose
                                               circuit breaker is open
    with choice.leg(target) as verdict: ... counts a prefill leg in flight on ``target``
                                            (``PrefillBreakerOpen`` when its breaker does not
                                            let it through); ``verdict.answered()`` /
                                            ``verdict.failed(why)`` feed the breaker
    choice.refused(target)                  its connect was refused: cool it down
    choice.answered(target)                 it answered a prefill: the cool-down ends

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
    LegRanks                             one runner's engines' sizes over the ``RankChoice``:
        .prefill(target, named)          the prefill leg's rank on ``target``'s engine
        .local(named)                    a leg's rank on the local engine (decode, gRPC Prefill)
        .hold(rank) / .release(rank)     a decode leg is busy on its local rank until it ends
        .held(exits, named)              a gRPC Decode's local rank, busy until ``exits`` closes

A rank is the router's ``named`` rank when it gave one, else the least busy, and None when
that engine has one rank: no leg then carries a rank. Only the dialect knows where a rank
goes (header, body field, looked-up id). The router's rank is parsed strictly like every
routing header: one value, ASCII decimal digits only (no sign, space or leading zero), below
the engines' data-parallel size; anything else is refused (400 / INVALID_ARGUMENT). It names
the prefill leg's rank over HTTP and the local engine's over gRPC, and is never forwarded to
an engine.

Deliberate limits: this process's own view (each ``--workers`` worker its own); the maps
forget a target with nothing in flight and no cool-down, and hold at most 4,096 cooling
targets or ranks (``CoolDowns``, on ``sidecar.bounded``); ties between ranks go to the next
in turn, so a sidecar whose legs never overlap still uses every rank. Why it picks this way,
and its bounded metric labels: docs/extending/design-notes.md#target-choice
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import (
    Callable,
    Collection,
    Hashable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from typing import Final, Generic, TypeVar

from sidecar.bounded import BoundedMap
from sidecar.errors import (
    InvalidRequest,
    PrefillBreakerOpen,
    PrefillFailed,
    PrefillMismatch,
    SidecarError,
)
from sidecar.protocol.context import PrefillTarget
from sidecar.targets.breaker import NORMAL, SEVERITY, Admission, BreakerState, CircuitBreakers

K = TypeVar("K", bound=Hashable)

#: Past this many candidates two random ones are compared instead of all (power of two
#: choices: nearly as even, and O(1) per pick however long the router's list).
_COMPARE_ALL_UP_TO = 4
#: The label of a target that a router named (not one of the static pool's).
HEADER_LABEL = "header"
#: Static-pool addresses labelled by themselves: past it, the longest not resolved is
#: labelled ``header`` again (it left the pool's DNS answer, or the pool has churned past it).
_MAX_POOL_LABELS: Final = 4096


class LegVerdict:
    """One prefill leg on a target (``TargetChoice.leg``), a context manager: counted in
    flight there from entry to exit, and what it showed of its target, given to the target's
    circuit breaker at exit. (A class, not a generator ``@contextmanager``: one object per leg
    instead of three, on every request's path.)"""

    __slots__ = ("_admission", "_choice", "_target", "down", "ok", "why")

    def __init__(self, choice: TargetChoice, target: PrefillTarget) -> None:
        self._choice = choice
        self._target = target
        self._admission: Admission | None = None
        self.ok: bool | None = None
        self.why = ""
        self.down = False

    def __enter__(self) -> LegVerdict:
        choice = self._choice
        target = self._target
        breakers = choice.breakers
        admission = NORMAL if breakers is None else breakers.admit(target)
        if admission is None:
            named = f" {target}" if choice.label(target) == HEADER_LABEL else ""
            raise PrefillBreakerOpen(f"circuit breaker of prefill target{named} is open")
        self._admission = admission
        in_flight = choice._in_flight
        in_flight[target] = in_flight.get(target, 0) + 1
        return self

    def __exit__(self, *exc_info: object) -> None:
        choice = self._choice
        target = self._target
        in_flight = choice._in_flight
        left = in_flight[target] - 1
        if left:
            in_flight[target] = left
        else:
            del in_flight[target]
        breakers = choice.breakers
        admission = self._admission
        if breakers is not None and admission is not None:
            breakers.settle(target, admission, self.ok, self.why, down=self.down)

    def answered(self) -> None:
        self.ok = True

    def failed(self, why: str, *, down: bool = False) -> None:
        """A failure that shows the engine unhealthy (never the request's own fault);
        ``down``: not even listening (its connect refused or never accepted)."""
        self.ok = False
        self.why = why
        self.down = down


class TargetChoice:
    """Least-in-flight choice among prefill targets, with a cool-down for refusing ones and
    a circuit breaker per target."""

    def __init__(
        self,
        *,
        cooldown_s: float,
        pool: Collection[PrefillTarget] = (),
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        breakers: CircuitBreakers | None = None,
        on_refused: Callable[[PrefillTarget], None] | None = None,
    ) -> None:
        self._cooldown_s = cooldown_s
        self._on_refused = on_refused
        self._clock = clock
        self._rng = rng or random.Random()
        self._in_flight: dict[PrefillTarget, int] = {}
        self._cooling: CoolDowns[PrefillTarget] = CoolDowns(cooldown_s, clock)
        # A pool name resolves anew on each use, and a headless service's addresses change
        # as its pods do: the labels of addresses no longer resolved are forgotten, oldest
        # resolved first, so the map holds what the pool is now, not all it ever was.
        self._pool_labels: BoundedMap[PrefillTarget, str] = BoundedMap(_MAX_POOL_LABELS)
        for target in pool:
            self._pool_labels[target] = str(target)
        self.breakers = breakers if breakers is not None and breakers.enabled else None

    def in_flight(self, target: PrefillTarget) -> int:
        return self._in_flight.get(target, 0)

    def cooling(self, target: PrefillTarget) -> bool:
        return self._cooling.active(target)

    def label(self, target: PrefillTarget) -> str:
        """The bounded metric label of ``target``: its address in the pool, else ``header``."""
        return self._pool_labels.peek(target, HEADER_LABEL)

    def tracks(self, label: str) -> bool:
        """Whether a breaker is kept for a target labelled ``label``."""
        return self.breakers is not None and any(
            self.label(target) == label for target in self.breakers.states())

    def breaker_state(self, label: str) -> BreakerState:
        """The worst breaker state among the targets labelled ``label`` (open > half-open >
        closed): one value per bounded label, as ``disagg_prefill_breaker_state`` shows it."""
        if self.breakers is None:
            return BreakerState.CLOSED
        states = [state for target, state in self.breakers.states().items()
                  if self.label(target) == label]
        return max(states, key=SEVERITY.__getitem__, default=BreakerState.CLOSED)

    def add_pool_member(self, target: PrefillTarget) -> None:
        """Label a resolved static-pool address by itself (pool names resolve at use); a
        member resolved again is the most recently resolved."""
        labels = self._pool_labels
        labels[target] = labels.peek(target) or str(target)

    def pick(
        self, candidates: Sequence[PrefillTarget], exclude: Collection[PrefillTarget] = ()
    ) -> PrefillTarget | None:
        """The target for the next prefill leg, or None when ``exclude`` leaves none."""
        breakers = self.breakers
        if len(candidates) == 1 and not exclude:
            # The usual router's one target: nothing to compare, a cool-down cannot skip it
            # (an only target is used anyway); only its breaker may keep it out.
            only = candidates[0]
            return only if breakers is None or breakers.allows(only) else None
        open_ = [t for t in candidates if t not in exclude]
        if breakers is not None:
            open_ = [t for t in open_ if breakers.allows(t)]
        if not open_:
            return None
        warm = [t for t in open_ if not self.cooling(t)]
        pool = warm or open_
        if len(pool) == 1:
            return pool[0]
        if len(pool) > _COMPARE_ALL_UP_TO:
            pool = self._rng.sample(pool, 2)
        least = min(self.in_flight(t) for t in pool)
        return self._rng.choice([t for t in pool if self.in_flight(t) == least])

    def all_open(self, candidates: Sequence[PrefillTarget]) -> PrefillFailed:
        """The error of a request whose every target's breaker is open (router-named ones
        named, pool members not: the router does not know them)."""
        breakers = self.breakers
        wait = min((breakers.retry_in(t) for t in candidates), default=0.0) if breakers else 0.0
        named = [str(t) for t in candidates if self.label(t) == HEADER_LABEL]
        which = f" ({', '.join(named)})" if named else ""
        every = "every prefill target" if len(candidates) > 1 else "the prefill target"
        return PrefillFailed(f"circuit breaker open for {every}{which}: its legs kept "
                             f"failing; next trial in {wait:.0f} s")

    def admissible(self, candidates: Sequence[PrefillTarget]) -> Sequence[PrefillTarget]:
        """The candidates whose breakers let a leg in now."""
        breakers = self.breakers
        if breakers is None:
            return candidates
        return [target for target in candidates if breakers.allows(target)]

    def unpaired(self, why: Mapping[PrefillTarget, str]) -> PrefillMismatch:
        """The error of a request none of whose targets can hand KV off to this engine
        (``why``: each one's reason; router-named targets named, pool members not)."""

        def named(target: PrefillTarget) -> str:
            return str(target) if self.label(target) == HEADER_LABEL else "a pool member"

        if len(why) == 1:
            [(target, reason)] = why.items()
            shown = f" {target}" if self.label(target) == HEADER_LABEL else ""
            return PrefillMismatch(f"the prefill target{shown} cannot hand KV off to this "
                                   f"engine: {reason}; nothing was sent to it")
        reasons = "; ".join(f"{named(target)}: {reason}" for target, reason in why.items())
        return PrefillMismatch(f"no prefill target can hand KV off to this engine ({reasons}); "
                               "nothing was sent to one")

    def leg(self, target: PrefillTarget) -> LegVerdict:
        """``with choice.leg(target) as verdict:`` counts one prefill leg in flight on
        ``target`` while the block runs, and gives its verdict to the target's breaker;
        ``PrefillBreakerOpen`` (before the block) when the breaker lets no leg through now
        (open, or its one trial leg already running)."""
        return LegVerdict(self, target)

    def answered(self, target: PrefillTarget) -> None:
        """``target`` answered a prefill: whatever refusal it had is over."""
        self._cooling.end(target)

    def refused(self, target: PrefillTarget) -> None:
        """``target`` refused a connection: skip it for the cool-down (and tell
        ``on_refused``: what was learned of it may be stale)."""
        self._cooling.start(target)
        if self._on_refused is not None:
            self._on_refused(target)


# -- cool-downs ------------------------------------------------------------------------------

#: Keys cooling down at most (the circuit breakers track as many targets).
MAX_COOLING: Final = 4096


class CoolDowns(Generic[K]):
    """``key -> cooling until``: keys skipped for ``cooldown_s`` after ``start`` (0 s: never).

    Keyed by prefill targets and their ranks, which a router names: at most ``MAX_COOLING``
    are kept; a new one past that first drops the expired ones (one cool-down for all and a
    key re-inserted last: they are the oldest), then the least recently started (50,000
    refused targets left 50,000 entries before).
    """

    __slots__ = ("_clock", "_cooldown_s", "_until")

    def __init__(self, cooldown_s: float, clock: Callable[[], float], *,
                 max_keys: int = MAX_COOLING) -> None:
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._until: BoundedMap[K, float] = BoundedMap(max_keys)

    def __len__(self) -> int:
        return len(self._until)

    def active(self, key: K) -> bool:
        """Still cooling (an expired entry is dropped on the way)."""
        until = self._until
        if not until:
            return False
        ends = until.peek(key)
        if ends is None:
            return False
        if self._clock() >= ends:
            until.pop(key, None)
            return False
        return True

    def start(self, key: K) -> None:
        """Skip ``key`` for the cool-down."""
        if self._cooldown_s <= 0:
            return
        now = self._clock()
        self._until.evict_while(lambda _, ends: ends <= now)
        self._until[key] = now + self._cooldown_s

    def end(self, key: K) -> None:
        """It answered: the cool-down is over."""
        if self._until:
            self._until.pop(key, None)


# -- data-parallel ranks --------------------------------------------------------------------

RANK_HEADER: Final = "x-data-parallel-rank"
#: Longer than any rank below the size bound (1024): refused before it is read as a number.
_MAX_DIGITS: Final = 4
#: Engines whose rank turn is remembered (a router's header may name many targets): the least
#: recently picked forgotten first (its next pick starts at rank 0 again).
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
        self._rank_turns: BoundedMap[Engine, int] = BoundedMap(_MAX_TURNS)

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
        turn = turns.peek(engine) or 0
        turns[engine] = (turn + 1) % size  # a write: the most recently picked
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


# -- the placement decision's view --------------------------------------------------------


class PrefillTargets:
    """The prefill targets as the placement decision sees them (its ``Targets``): the target
    choice with its breakers, and the data-parallel ranks of both legs."""

    __slots__ = ("_choice", "ranks")

    def __init__(self, choice: TargetChoice, ranks: LegRanks) -> None:
        self._choice = choice
        self.ranks = ranks

    def pick(self, candidates: Sequence[PrefillTarget],
             exclude: Collection[PrefillTarget] = ()) -> PrefillTarget | None:
        return self._choice.pick(candidates, exclude)

    def all_open(self, candidates: Sequence[PrefillTarget]) -> SidecarError:
        return self._choice.all_open(candidates)

    def admissible(self, candidates: Sequence[PrefillTarget]) -> Sequence[PrefillTarget]:
        return self._choice.admissible(candidates)

    def unpaired(self, why: Mapping[PrefillTarget, str]) -> SidecarError:
        return self._choice.unpaired(why)

    def prefill_rank(self, target: PrefillTarget, named: int | None) -> int | None:
        return self.ranks.prefill(target, named)

    def decode_rank(self) -> int | None:
        return self.ranks.local()
