"""What an engine serves: its model and the layout of its KV cache, as the engine says them.

    GET /v1/models ─▶ {"object": "list", "data": [{"id": "<name>", "root": "<weights>", ...}]}
                   ─▶ data[0]: the served model (its name, and where its weights came from)
    GET <the dialect's KV layout source> ─▶ the facts two engines must share to hand KV over
                   (vLLM: ``/metrics``' ``vllm:cache_config_info``: the KV cache's dtype)

``EngineModel``: the local engine's served name, for the bodies the gRPC front door builds
(looked up once; fails as ``EngineNotReady``: gRPC UNAVAILABLE, a router retries elsewhere).

``ServedModels``: what the local engine and each prefill target serve, so that a pair never
joins two engines that cannot hand off (``mismatch``: None, or why not):

- the model: the same served name and the same weights (``root``, where the engine gives
  it); users roll out model revisions one pool at a time, and KV computed by one revision is
  garbage to another;
- the KV layout facts both engines state (a fact only one states, or a source that failed,
  is not compared: the model is the rule, the layout what the engines add to it);
- a target that does not say what it serves (no answer in time, an error status, no model
  listed) is not paired: "never" is the rule; one that gives no HTTP answer at all
  (refused, unreachable, a failed TLS handshake, the connection closed) is down, which is
  the legs' and its circuit breaker's business (its leg meets the same, at once).

Learned facts are kept ``refresh_s`` (an engine restarted in place may serve another
revision), then asked again; a refresh that fails keeps them (an engine that answers late
did not change its model), one that finds the engine down drops them, and so does
``forget`` (its pod left the pool, or a leg's connect was refused). A verdict is kept as
long as the facts it was made of (a pair asks it at a dict's speed). One look-up per engine
at a time (``SingleFlightTTLCache``); at most ``MAX_ENGINES`` engines kept, the oldest
learned first (``sidecar.bounded``).

Why a lookup, and why the first entry: docs/extending/design-notes.md#engine-model
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, Literal

from sidecar import jsonutil
from sidecar.bounded import BoundedMap
from sidecar.dialects.base import KVLayoutSource
from sidecar.errors import EngineNotReady, Stage
from sidecar.http1 import EngineClient, UpstreamError
from sidecar.protocol.context import PrefillTarget
from sidecar.ttl_cache import SingleFlightTTLCache

MODELS_PATH: Final = "/v1/models"
_MAX_MODELS_BYTES: Final = 1024 * 1024
#: An engine's metrics page (a KV layout source) is longer than its models list.
_MAX_LAYOUT_BYTES: Final = 8 * 1024 * 1024
#: Seconds a learned engine's facts are used before they are asked again.
REFRESH_S: Final = 60.0
#: Engines whose facts are kept (prefill targets a router names, and the local engine).
MAX_ENGINES: Final = 4096
#: The local engine, as a key of the facts (a prefill target names a remote one).
LOCAL: Final = None

#: What kind of mismatch keeps a target from a pair (``disagg_prefill_mismatches_total``).
MismatchKind = Literal["model", "kv_layout", "unknown"]


@dataclass(frozen=True, slots=True)
class Serves:
    """What an engine serves: the first model it lists, and its KV layout facts."""

    model: str
    #: Where its weights came from (the list entry's ``root``), when the engine says.
    root: str | None = None
    #: (fact, value) pairs, sorted; empty when the engine states none.
    layout: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        return self.model if self.root in (None, self.model) else f"{self.model} ({self.root})"


@dataclass(frozen=True, slots=True)
class NotLearned:
    """An engine did not say what it serves: why, and whether no HTTP answer came at all
    (down: refused, unreachable, a failed TLS handshake, the connection closed or garbled;
    health's business, not a mismatch)."""

    cause: str
    down: bool = False


Learned = Serves | NotLearned


@dataclass(frozen=True, slots=True)
class Mismatch:
    """Why a prefill target cannot hand off to the local engine."""

    kind: MismatchKind
    why: str


def mismatch(local: Learned, target: Learned) -> Mismatch | None:
    """Why ``target`` cannot hand KV off to ``local`` (None: it can, or one is down)."""
    if isinstance(target, NotLearned):
        if target.down:
            return None
        return Mismatch("unknown", f"it does not say what it serves ({target.cause})")
    if isinstance(local, NotLearned):
        if local.down:
            return None  # the local engine's own health decides (the placement refuses)
        return Mismatch("unknown", f"the local engine does not say what it serves "
                                   f"({local.cause})")
    if target.model != local.model or (target.root is not None and local.root is not None
                                       and target.root != local.root):
        return Mismatch("model", f"it serves {target}, the local engine {local}")
    theirs = dict(target.layout)
    for fact, value in local.layout:
        other = theirs.get(fact)
        if other is not None and other != value:
            return Mismatch("kv_layout", f"its KV cache has {fact} {other}, the local "
                                         f"engine's {value}")
    return None


def _first_model(payload: object) -> tuple[str, str | None] | None:
    if not isinstance(payload, Mapping):
        return None
    data = payload.get("data")
    if not isinstance(data, list) or not data or not isinstance(data[0], Mapping):
        return None
    model, root = data[0].get("id"), data[0].get("root")
    if not isinstance(model, str) or not model:
        return None
    return model, root if isinstance(root, str) and root else None


class _Unlearned(Exception):
    def __init__(self, cause: str, *, down: bool = False) -> None:
        super().__init__(cause)
        self.cause = cause
        self.down = down


async def _get(session: EngineClient, base_url: str, path: str, tls_name: str | None,
               timeout_s: float, max_bytes: int) -> bytes:
    """A small GET's body; ``_Unlearned`` when it fails (down: no HTTP answer came), it is
    late, an error status, or a body over ``max_bytes``."""
    try:
        # The answer within ``timeout_s`` of being sent, the connect within its own.
        response = await session.request(
            "GET", base_url + path, server_hostname=tls_name, read_timeout_s=timeout_s,
            timeout_s=session.connect_timeout_s + timeout_s)
        async with response:
            raw = await response.read(max_bytes)
            status = response.status
    except TimeoutError:
        raise _Unlearned(f"no answer to GET {path} within {timeout_s:g} s") from None
    except UpstreamError as exc:
        # Refused, unreachable, a failed handshake, closed or garbled: its legs will meet
        # the same (the legs' and its breaker's business).
        raise _Unlearned(exc.reason, down=True) from None
    if status != 200:
        raise _Unlearned(f"GET {path} answered HTTP {status}")
    if len(raw) > max_bytes:
        raise _Unlearned(f"GET {path} answered more than {max_bytes} bytes")
    return raw


async def _model(session: EngineClient, base_url: str, tls_name: str | None,
                 timeout_s: float) -> tuple[str, str | None]:
    raw = await _get(session, base_url, MODELS_PATH, tls_name, timeout_s, _MAX_MODELS_BYTES)
    try:
        payload = jsonutil.loads(raw)
    except jsonutil.JSONDecodeError:
        payload = None
    model = _first_model(payload)
    if model is None:
        raise _Unlearned(f"GET {MODELS_PATH} lists no model")
    return model


class EngineModel:
    """Looks up (once) the model the local engine serves."""

    def __init__(self, session: EngineClient, engine_url: str, *, timeout_s: float,
                 stage: Stage = Stage.DECODE) -> None:
        self._session = session
        self._url = engine_url.rstrip("/")
        self._timeout_s = timeout_s
        self._stage = stage
        self._name: str | None = None
        self._lock = asyncio.Lock()

    async def name(self) -> str:
        """The served model name; raises ``EngineNotReady`` when the engine cannot say."""
        if self._name is not None:
            return self._name
        async with self._lock:
            if self._name is None:
                try:
                    self._name = (await _model(self._session, self._url, None,
                                               self._timeout_s))[0]
                except _Unlearned as failed:
                    raise EngineNotReady(f"local engine did not say its model: {failed.cause}",
                                         stage=self._stage) from None
            return self._name


class ServedModels:
    """What the local engine and each prefill target serve (see the module docstring)."""

    def __init__(self, session: EngineClient, engine_url: str, *, timeout_s: float,
                 layout: KVLayoutSource | None = None, refresh_s: float = REFRESH_S,
                 max_engines: int = MAX_ENGINES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._session = session
        self._engine_url = engine_url.rstrip("/")
        self._timeout_s = timeout_s
        self._layout = layout
        # The facts in use (each for ``refresh_s``, one look-up at a time), and the last
        # learned of each engine (kept through a refresh that fails).
        self._fresh: SingleFlightTTLCache[PrefillTarget | None, Serves] = SingleFlightTTLCache(
            refresh_s, max_entries=max_engines, clock=clock)
        self._last: BoundedMap[PrefillTarget | None, Serves] = BoundedMap(max_engines)
        #: The verdict on each target both engines' facts gave: (valid until, by ``clock``,
        #: the mismatch or None). Every pair asks: a fresh one is read with ``peek`` at a
        #: dict's speed (``fresh_verdict``), a stale or missing one through ``mismatch``.
        self.verdicts: BoundedMap[PrefillTarget, tuple[float, Mismatch | None]] = BoundedMap(
            max_engines)
        self._refresh_s = refresh_s
        self.clock = clock

    async def mismatch(self, target: PrefillTarget) -> Mismatch | None:
        """Why ``target`` cannot hand KV off to the local engine (None: it can, or it is
        down: its leg will say so)."""
        verdict = self.verdicts.peek(target)
        if verdict is not None and verdict[0] > self.clock():
            return verdict[1]
        learned = await self.of(target)
        if isinstance(learned, NotLearned) and learned.down:
            return None
        local = await self.of(LOCAL)
        found = mismatch(local, learned)
        if isinstance(learned, Serves) and isinstance(local, Serves):
            self.verdicts[target] = (self.clock() + self._refresh_s, found)
        return found

    async def of(self, engine: PrefillTarget | None) -> Learned:
        """What ``engine`` (a prefill target, or ``LOCAL``) serves, as far as it is known."""
        try:
            return await self._fresh.get(engine, lambda: self._learn(engine))
        except _Unlearned as failed:
            if failed.down:
                # Restarted, it may serve another revision.
                self._last.pop(engine, None)
                if engine is not None:
                    self.verdicts.pop(engine, None)
                return NotLearned(failed.cause, down=True)
            last = self._last.peek(engine)
            return last if last is not None else NotLearned(failed.cause)

    def forget(self, target: PrefillTarget) -> None:
        """Forget what ``target`` served (its pod left the pool, or it refused a connection:
        restarted, it may serve another revision)."""
        self._fresh.forget(target)
        self._last.pop(target, None)
        self.verdicts.pop(target, None)

    async def _learn(self, engine: PrefillTarget | None) -> Serves:
        if engine is None:
            base_url, tls_name = self._engine_url, None
        else:
            base_url, tls_name = engine.base_url, engine.tls_name
        name, root = await _model(self._session, base_url, tls_name, self._timeout_s)
        layout: tuple[tuple[str, str], ...] = ()
        source = self._layout
        if source is not None:
            try:
                raw = await _get(self._session, base_url, source.path, tls_name,
                                 self._timeout_s, _MAX_LAYOUT_BYTES)
            except _Unlearned:
                raw = None  # the layout is compared where both engines state it
            facts = None if raw is None else source.read(raw)
            layout = tuple(sorted(facts.items())) if facts else ()
        serves = self._last[engine] = Serves(name, root, layout)
        return serves

    async def close(self) -> None:
        """Stop the look-ups still running (shutdown)."""
        await self._fresh.close()
