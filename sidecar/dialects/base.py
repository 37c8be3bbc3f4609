"""What a dialect is: everything the sidecar knows about one engine (and one KV connector).

    ctx = dialect.begin(ctx)              this request's state (``ctx.state``, opaque to the core)
    ctx = await dialect.look_up(ctx)      only when ``looks_up``: values the engines must tell
    dialect.prefill_body(client, ctx)  ─▶ POST prefill ─▶ answer ─dialect.handoff(answer, ctx)─▶
    dialect.decode_body(client, fields)─▶ POST decode (local engine)
    dialect.end(ctx)                      the state given back (once the request is over)

Data-parallel engines (``--data-parallel-size``): for a dialect that is ``ranked`` the flow
chooses each leg's rank and the dialect puts it where its engine reads it: a header
(``prefill_headers``/``decode_headers``), a body field (``prefill_fields`` reads
``ctx.prefill_rank``; ``decode_body`` gets the decode rank), or the looked-up value of that
rank. With one rank both are None and nothing changes; a dialect that is not ``ranked`` gets
none (its engine places requests on its ranks itself).

``legs`` says whether the decode waits for the prefill's answer (``SEQUENTIAL``) or both go
at once (``CONCURRENT``: the hand-off is known before the prefill answers, and the core
watches the prefill); ``legs_for(ctx)`` may decide it per request (a dialect that learns
what the hand-off needs from a target's first answer runs that one's legs in turn). A
dialect that ``learns`` is also shown each concurrent prefill's answer (``answered_stale``:
was the hand-off the decode got out of date?) and each failed leg (``leg_failed``).
Everything else a dialect declares is data: the body keys it owns (``handoff_keys``: clients
may not send them), the request keys that make a streamed completion carry token ids
(``token_id_fields``), its abort call, its tokenizer endpoint, the settings it adds
(``Options``). The core never names an engine: it asks the dialect.

A migration (``sidecar.request.migration``) asks the dialect where a route's stream carries
token ids (``token_ids``), what a request's ids read as text (``ids_text``), which requests
cannot be continued exactly (``continuation_refusal``), the body that continues an answer on
another engine (``continuation``), and whether a prefill engine can run one whole
(``prefill_decodes``).

Dialects do no I/O of their own. The one lookup a hand-off may need (an engine id that only
the prefill's side channel tells) goes through the ``EngineLookup`` the core hands in.

Deliberate limits: dialects do no I/O of their own (a side-channel lookup goes through the
``EngineLookup`` the core hands in); one instance serves every request of a process (its id
sources are the process's); per-request values live in ``ctx.state`` only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any, ClassVar, Literal, NamedTuple, Protocol, Self

from pydantic import BaseModel, ConfigDict

from sidecar.errors import SidecarError
from sidecar.protocol.apis import api_of
from sidecar.protocol.context import OPENAI_ROUTES, HandoffContext, Route
from sidecar.protocol.continuation import TokenIdPlaces
from sidecar.protocol.sse import StreamMarkers


class RouteSupport(StrEnum):
    """What a dialect's engine does with a route a prefill target was named for."""

    #: Runs as a prefill/decode pair with the engine's hand-off fields.
    PD = "pd"
    #: The engine serves the route, but not as a pair: the request runs whole on it.
    LOCAL = "local"
    #: The engine does not serve the route at all: refused (404).
    UNSERVED = "unserved"


class Legs(StrEnum):
    """How a dialect's two legs run."""

    #: Prefill first; the decode body is built from its answer.
    SEQUENTIAL = "sequential"
    #: Both at once (the engines rendezvous); a failed prefill aborts the decode.
    CONCURRENT = "concurrent"


@dataclass(frozen=True, slots=True)
class TokenizeEndpoint:
    """An engine's tokenizer endpoint: its path, whether it takes chat messages, and what a
    request holds that changes the ids the engine computes or keys its KV blocks by."""

    path: str
    chat: bool
    #: Chat request fields that change how the engine renders the messages (sent along).
    chat_fields: tuple[str, ...] = ()
    #: Completions request fields that change the prompt's ids (sent along when present).
    prompt_fields: tuple[str, ...] = ()
    #: Request fields that, set, key the request's KV blocks apart from a plain prompt's (a
    #: salt), or change its ids in a way the endpoint does not (a truncation): such a request's
    #: ids are not looked up in the engine's cache.
    unkeyed_fields: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class KVLayoutSource:
    """Where an engine states how its KV cache is laid out (a path it answers GET on), and
    how to read from that answer the facts two engines must share to hand KV over (None:
    it states none). ``sidecar.engines.models`` compares them before a pair."""

    path: str
    read: Callable[[bytes], Mapping[str, str] | None]


@dataclass(frozen=True, slots=True)
class IdsText:
    """An engine's endpoint that reads token ids back as text: its path, the body's field
    for the ids and the answer's field for the text (and fields the body always carries)."""

    path: str
    ids_field: str
    text_field: str
    extra: Mapping[str, Any] = field(default_factory=dict)


class PodSource(NamedTuple):
    """Where in the pod's metadata a setting can come from (below flags and env)."""

    kind: Literal["label", "annotation"]
    #: The settings field whose value is the label or annotation key.
    key_field: str
    #: How the label's text is read: as it is, or as a port number.
    parse: Literal["text", "port"] = "text"


class DialectOptions(BaseModel):
    """The settings a dialect adds to the sidecar's (flags, env, pod labels, docs): every
    field needs a ``description`` (the flag's help and a row of the generated reference
    (docs/operating/configuration.md));
    ``pod_sources`` names fields a pod label or annotation can set."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    pod_sources: ClassVar[Mapping[str, PodSource]] = MappingProxyType({})

    @classmethod
    def of(cls, settings: object) -> Self:
        """This dialect's options, read from the whole settings object."""
        return cls.model_validate(settings, from_attributes=True)


class LookupFailed(Exception):
    """An ``EngineLookup`` GET that could not be answered (unreachable, reset, too slow)."""


class EngineLookup(Protocol):
    """A small GET to an engine's side channel, done by the core's client for a dialect."""

    async def get(self, url: str, *, max_bytes: int) -> tuple[int, bytes]:
        """The answer's status and body (within the core's connect deadline); raises
        ``LookupFailed`` when there is none."""


@dataclass(frozen=True, slots=True)
class DialectSetup:
    """What a dialect is built from, once per process."""

    #: The sidecar's settings (a dialect reads its own fields through ``Options.of``).
    settings: object
    #: This worker's lane of ``lanes`` (``--workers``): ids drawn here never meet another's.
    lane: int = 0
    lanes: int = 1
    lookup: EngineLookup | None = None
    #: Data-parallel ranks of the local engine and of each prefill target's engine.
    local_ranks: int = 1
    prefill_ranks: int = 1


#: The headers of a leg that needs none besides the client's.
NO_HEADERS: Mapping[str, str] = MappingProxyType({})

#: vLLM's (and SGLang's) documented switch for token ids on a streamed completion.
RETURN_TOKEN_IDS: Mapping[str, Any] = MappingProxyType({"return_token_ids": True})


class Dialect(ABC):
    """One engine's (and one KV connector's) side of a prefill/decode pair."""

    #: The engine's wire name (the engine pod label's value), e.g. "sglang".
    engine: ClassVar[str]
    #: The KV connector's wire name (the connector label's value), or None.
    connector: ClassVar[str | None] = None
    #: Other names of the connector (its engine's own class name, e.g. vLLM's
    #: ``"NixlConnector"`` for the label value ``shfs``), accepted case-insensitively wherever
    #: the connector is named: flags, environment, pod labels.
    aliases: ClassVar[tuple[str, ...]] = ()
    #: The engine versions whose wire format this dialect was checked against.
    checked_against: ClassVar[str] = ""
    legs: ClassVar[Legs] = Legs.SEQUENTIAL
    #: True when ``look_up`` must run before the hand-off can be built.
    looks_up: ClassVar[bool] = False
    #: True when the dialect keeps what prefill answers and failed legs tell it
    #: (``answered_stale``, ``leg_failed`` are called only then).
    learns: ClassVar[bool] = False
    #: Top-level body keys of this dialect's hand-off (only the sidecar may set them).
    handoff_keys: ClassVar[frozenset[str]] = frozenset()
    #: Top-level request fields that make a streamed completion carry token ids.
    token_id_fields: ClassVar[Mapping[str, Any]] = RETURN_TOKEN_IDS
    #: True when the engine rejects ``max_completion_tokens`` on the prefill leg.
    drops_max_completion_tokens: ClassVar[bool] = False
    #: The engine's tokenizer endpoint, if it has one.
    tokenize: ClassVar[TokenizeEndpoint | None] = None
    #: Where the engine states its KV cache's layout, if it does (a pair joins engines
    #: whose stated facts agree).
    kv_layout: ClassVar[KVLayoutSource | None] = None
    #: The routes this engine serves as prefill/decode pairs with its hand-off fields
    #: (the routes table of docs/driving/routes.md); the others run whole on the local engine, or
    #: are refused.
    pd_routes: ClassVar[frozenset[Route]] = OPENAI_ROUTES
    #: The routes this engine does not serve at all (refused with 404, not passed through).
    unserved_routes: ClassVar[frozenset[Route]] = frozenset()
    #: The settings this dialect adds (None: none).
    Options: ClassVar[type[DialectOptions] | None] = None
    #: True when the dialect puts data-parallel ranks where its engine reads them.
    ranked: ClassVar[bool] = False
    #: The request header the engine reads a leg's data-parallel rank from (None: elsewhere,
    #: or nowhere).
    rank_header: ClassVar[str | None] = None
    #: True when a prefill engine also runs requests whole (it can take a migrated one).
    prefill_decodes: ClassVar[bool] = False
    #: The engine's endpoint that reads token ids back as text (None: it has none).
    ids_text: ClassVar[IdsText | None] = None

    def __init__(self, setup: DialectSetup) -> None:
        self.setup = setup

    @classmethod
    def route_support(cls, route: Route) -> RouteSupport:
        """How a request on ``route`` with a prefill target runs on this engine."""
        if route in cls.pd_routes:
            return RouteSupport.PD
        return RouteSupport.UNSERVED if route in cls.unserved_routes else RouteSupport.LOCAL

    @property
    def connector_label(self) -> str:
        """The connector as metrics and hand-off blocks name it ("none" without one)."""
        return self.connector or "none"

    # -- per-request state ------------------------------------------------------------------

    def begin(self, ctx: HandoffContext) -> HandoffContext:
        """``ctx`` with this request's state (ids, rooms); default: none."""
        return ctx

    async def look_up(self, ctx: HandoffContext) -> HandoffContext:
        """``ctx`` with what the engines must tell first (``looks_up`` dialects only)."""
        return ctx

    def end(self, ctx: HandoffContext) -> None:  # noqa: B027 (optional: most take nothing)
        """Give back what ``begin`` took (called once, when the request's legs are over)."""

    async def close(self) -> None:  # noqa: B027 (optional: most run nothing of their own)
        """Stop what the dialect runs of its own (a look-up in flight) at shutdown."""

    def legs_for(self, ctx: HandoffContext) -> Legs:
        """How this request's legs run (after ``look_up``); default: ``legs``."""
        return self.legs

    def answered_stale(self, prefill_response: Mapping[str, Any], ctx: HandoffContext) -> bool:
        """A concurrent prefill's answer (``learns`` dialects only): True when it shows that
        the hand-off the decode got was out of date (the dialect keeps the answer's news)."""
        return False

    def leg_failed(self, error: Exception, ctx: HandoffContext) -> None:  # noqa: B027
        """A leg of this request failed (``learns`` dialects only): forget what it disproves."""

    def refusal_may_be_stale(self, refused: SidecarError, ctx: HandoffContext) -> bool:
        """A concurrent decode the engine refused (``learns`` dialects only): True when what
        the dialect learned may explain it (a stale hand-off), so that the prefill's answer is
        awaited to tell; False ends the pair at once (its prefill cancelled)."""
        return False

    # -- bodies -----------------------------------------------------------------------------

    def prefill_body(self, client_body: Mapping[str, Any], ctx: HandoffContext) -> dict[str, Any]:
        """The body POSTed to the prefill engine: the route's API's prefill rules plus this
        dialect's fields."""
        body = api_of(ctx.route).prefill_base(
            client_body, drop_max_completion_tokens=self.drops_max_completion_tokens
        )
        body.update(self.prefill_fields(ctx))
        return body

    def prefill_fields(self, ctx: HandoffContext) -> dict[str, Any]:
        """Dialect-specific top-level fields of the prefill body (default: none)."""
        return {}

    @abstractmethod
    def handoff(
        self, prefill_response: Mapping[str, Any] | None, ctx: HandoffContext
    ) -> dict[str, Any]:
        """Top-level fields the decode body gets; raises ``InvalidHandoff`` when unusable
        (``prefill_response`` is None for concurrent dialects: built before it answers)."""

    def decode_body(
        self, client_body: Mapping[str, Any], handoff: Mapping[str, Any],
        rank: int | None = None,
    ) -> dict[str, Any]:
        """The decode body: the *original* client body with the hand-off fields set
        (``rank``: the decode leg's data-parallel rank, None for one rank)."""
        return merge_top_level(client_body, handoff)

    def answered_by_prefill(self, prefill_response: Mapping[str, Any]) -> bool:
        """True when the prefill response already is the whole answer."""
        return False

    def prefill_answer(self, prefill_response: Mapping[str, Any]) -> dict[str, Any]:
        """A prefill response that is the whole answer, as the client sees it."""
        return dict(prefill_response)

    # -- data-parallel ranks ----------------------------------------------------------------

    def prefill_headers(self, ctx: HandoffContext) -> Mapping[str, str]:
        """Headers the prefill leg gets besides the client's (its rank: ``ctx.prefill_rank``,
        in ``rank_header`` where the engine reads it there)."""
        return self.decode_headers(ctx.prefill_rank)

    def decode_headers(self, rank: int | None) -> Mapping[str, str]:
        """Headers the decode leg on data-parallel ``rank`` gets (None: the engine has one):
        the rank in ``rank_header``, for an engine that reads it there.

        The decode leg's own rank only: over gRPC the decode sidecar has no ``ctx`` (what it
        needs of the prefill's rank travels in the hand-off fields).
        """
        name = self.rank_header
        return NO_HEADERS if name is None or rank is None else {name: str(rank)}

    # -- engine calls the core makes for the dialect ----------------------------------------

    def abort_call(self, ctx: HandoffContext) -> tuple[str, dict[str, Any]] | None:
        """The engine's abort endpoint and body for this request's legs, if it has one."""
        return None

    def decode_failure_hint(self, ctx: HandoffContext) -> str | None:
        """What to check when the decode engine failed a pair's decode leg (5xx, broken): for
        engines that rendezvous, the setting both sides must agree on; None: no hint."""
        return None

    # -- migration: an answer continued on another engine ---------------------------------

    def token_ids(self, route: Route) -> TokenIdPlaces | None:
        """Where this engine's stream on ``route`` carries token ids once asked (None: it
        carries none, so its streams are never continued)."""
        return None

    def continuation_refusal(self, route: Route, body: Mapping[str, Any]) -> str | None:
        """Why ``body`` cannot be continued token for token on another engine (None: it can)."""
        return None

    def continuation(self, route: Route, body: Mapping[str, Any], prompt_ids: list[int],
                     ids: list[int]) -> tuple[Route, dict[str, Any]]:
        """The rest of ``body``'s answer as a request to another engine (the route it goes to,
        its body): the prompt's ids and the answer's so far as its prompt."""
        raise NotImplementedError(f"the {self.engine} engine does not continue answers")

    def stream_markers(self, route: Route) -> StreamMarkers:
        """How this engine's stream on ``route`` ends, and how an error event in it starts
        (the API's markers, unless the engine's differ)."""
        return api_of(route).markers


def check_lane(lane: int, lanes: int, most: int) -> None:
    """Raise ``ValueError`` unless ``lane`` is one of ``lanes`` (at most ``most``) lanes."""
    if not 1 <= lanes <= most:
        raise ValueError(f"lanes {lanes} is outside 1..{most}")
    if not 0 <= lane < lanes:
        raise ValueError(f"lane {lane} is outside 0..{lanes - 1}")



def merge_top_level(body: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``body`` with ``fields`` set at the top level: values are not copied and the
    input is not mutated, so ``messages``, ``tools`` and every nested value stay the very
    objects the client sent (stable tokenization, prefix-cache hits), and a key the client
    omitted stays omitted on the decode leg (docs/driving/handoffs.md#common-rules)."""
    merged = dict(body)
    merged.update(fields)
    return merged
