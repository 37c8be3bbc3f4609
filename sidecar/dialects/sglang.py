"""SGLang: bootstrap host, port and room on both legs, sent at the same time.

    begin: room := a free room (int64 over HTTP; int32 over gRPC, as SGLang's own gRPC has it)
    prefill fields == decode fields == {bootstrap_host, bootstrap_port, bootstrap_room, rid}
    end:   the room is free again

Both legs also carry ``rid`` (SGLang's request id field), so the sidecar can name the request
in ``POST /abort_request`` when the client goes away or the prefill fails. The fields are set
after the client's keys, so client-supplied bootstrap values are always overwritten.

Routes (SGLang 0.5.23, ``srt/entrypoints``): completions and chat; the Responses API
(``ResponsesRequest(PDRoutingFields)``, forwarded to the engine's generate call) and the
Anthropic Messages API (``AnthropicMessagesRequest(PDRoutingFields)``, converted to a chat
request with the same fields) take the three bootstrap fields at the top level too, so they
run as pairs. The engine's request id is a per-route field: ``rid`` on the OpenAI routes,
``request_id`` on Responses (it is also the response's id, so it keeps the ``resp_`` prefix),
none on Messages (the conversion drops it: no abort by id there). ``/inference/v1/generate``
is not served (SGLang's ``/generate`` is another API): refused. A Responses request naming
stored state runs whole (SGLang forbids its response store in PD mode, and answers so).

Data-parallel engines (prefill rank r of P ranks, decode rank d; SGLang 0.5.23
``PDRoutingFields``, and SGLang's model gateway does the same):

    room      := a free room with room % P == r (SGLang's default prefill placement,
                 ``follow_bootstrap_room``, puts the request on that rank, and its decode
                 finds the KV there even without the hint)
    prefill  += {routed_dp_rank: r}
    decode   += {disagg_prefill_dp_rank: r (in the hand-off), routed_dp_rank: d}

Each only where the engine has several ranks: with one rank nothing is added and rooms are
drawn as without data parallelism.

Rooms (``RoomAllocator``): random, non-negative, unique among the rooms in flight (a reused
room can inherit a stale failure); in a pool of workers each worker draws from its own lane
(``room % lanes == lane``; with P ranks ``(room // P) % lanes == lane``), so no two workers
of one pod can hand out the same room, in either range.

Migration (``sidecar.request.migration``; SGLang main, 2026: ``protocol.py``,
``serving_completions.py``, ``serving_chat.py``, ``serving_tokenize.py``): its completions
stream carries each chunk's ``token_ids`` and the first chunk's ``prompt_token_ids`` on the
choice with ``return_token_ids`` (both left out when not asked); its chat route refuses
``return_token_ids`` on a stream, and no other route streams ids, so only completions
continue. An SGLang prefill server cannot run a request whole: a moved answer continues only
on the engines ``--migration-url`` names (servers that run requests start to end).
``/v1/detokenize`` reads ids back as text (``{"tokens"}`` -> ``{"text"}``).

Deliberate limits: one room per request (fan-out gives each sub-request its own).
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

from pydantic import Field

from sidecar.dialects.base import (
    Dialect,
    DialectOptions,
    DialectSetup,
    IdsText,
    Legs,
    PodSource,
    TokenizeEndpoint,
    check_lane,
    merge_top_level,
)
from sidecar.dialects.continuation import completions_places, continuation_body, refusal
from sidecar.errors import ResourceExhausted, SidecarError
from sidecar.protocol.context import OPENAI_ROUTES, FrontDoor, HandoffContext, Route
from sidecar.protocol.continuation import TokenIdPlaces

BOOTSTRAP_HOST: Final = "bootstrap_host"
BOOTSTRAP_PORT: Final = "bootstrap_port"
BOOTSTRAP_ROOM: Final = "bootstrap_room"
#: SGLang's request id field on its OpenAI routes; ``POST /abort_request {"rid"}`` names it.
RID: Final = "rid"
#: The field holding the engine's request id where a route does not take ``rid`` (None: none).
RID_FIELDS: Final[dict[Route, str | None]] = {Route.RESPONSES: "request_id",
                                              Route.MESSAGES: None}
#: A Responses request id is also the response's id, which the API prefixes so.
RESPONSE_ID_PREFIX: Final = "resp_"
ABORT_PATH: Final = "/abort_request"
#: The data-parallel rank a request runs on (SGLang's ``routed_dp_rank``, which replaced
#: ``data_parallel_rank``), and the prefill's rank a decode finds the KV on.
ROUTED_DP_RANK: Final = "routed_dp_rank"
DISAGG_PREFILL_DP_RANK: Final = "disagg_prefill_dp_rank"
#: Draws of a taken room before a room class counts as full (only a nearly full class of
#: rooms, shared with the other range's rooms, comes near it).
_MAX_DRAWS: Final = 1000

INT64_ROOMS: Final = (1 << 63) - 1
INT32_ROOMS: Final = (1 << 31) - 1


#: Where SGLang's completions stream carries token ids (left out when not asked).
COMPLETIONS_IDS: Final = completions_places(unasked_null=False)


class SGLangOptions(DialectOptions):
    """SGLang's settings."""

    sglang_bootstrap_port: int = Field(
        default=8998, ge=1, le=65535, description="SGLang's disaggregation bootstrap port."
    )
    sglang_bootstrap_port_annotation: str = Field(
        default="model.aibrix.ai/sglang-bootstrap-port",
        min_length=1,
        description="Annotation holding SGLang's bootstrap port.",
    )

    pod_sources = MappingProxyType({
        "sglang_bootstrap_port": PodSource("annotation", "sglang_bootstrap_port_annotation",
                                           "port"),
    })


class RoomAllocator:
    """Random bootstrap rooms in ``[0, max_room]``, unique among those in flight.

    ``lane`` of ``lanes``: one worker's share. A room for data-parallel ``rank`` of ``ranks``
    is ``rank + ranks * m`` with ``m % lanes == lane``; with one rank ``room % lanes == lane``.
    """

    def __init__(self, max_room: int = INT64_ROOMS, *, lane: int = 0, lanes: int = 1) -> None:
        if max_room < 1:
            raise ValueError("max_room must be positive")
        check_lane(lane, lanes, max_room)
        self._max_room = max_room
        self._lane = lane
        self._lanes = lanes
        #: Rooms in flight, each with its class: (max_room, ranks, rank) it was drawn for.
        self._in_flight: dict[int, tuple[int, int, int]] = {}
        self._taken: dict[tuple[int, int, int], int] = {}
        self._lock = threading.Lock()

    def narrowed(self, max_room: int) -> RoomAllocator:
        """An allocator over ``[0, max_room]`` sharing this one's rooms in flight.

        Sharing the in-flight rooms keeps int32 rooms unique against the int64 ones on the
        same prefill engine.
        """
        view = RoomAllocator(min(max_room, self._max_room), lane=self._lane, lanes=self._lanes)
        view._in_flight = self._in_flight
        view._taken = self._taken
        view._lock = self._lock
        return view

    @property
    def max_room(self) -> int:
        return self._max_room

    def _capacity(self, ranks: int, rank: int) -> int:
        """How many rooms this lane has for ``rank`` of ``ranks``: ``rank + ranks * m`` with
        ``m = lane + lanes * k`` below the top."""
        top = (self._max_room - rank) // ranks
        return 0 if top < self._lane else (top - self._lane) // self._lanes + 1

    def allocate(self, rank: int | None = None, ranks: int = 1) -> int:
        """A free room; for data-parallel ``rank`` of ``ranks``, one with ``room % ranks ==
        rank`` (None: any room, as with one rank)."""
        residue = 0 if rank is None else rank
        if not 0 <= residue < ranks:
            raise ValueError(f"rank {rank} is outside 0..{ranks - 1}")
        kind = (self._max_room, ranks, residue)
        capacity = self._capacity(ranks, residue)
        with self._lock:
            if self._taken.get(kind, 0) >= capacity:
                raise ResourceExhausted("every SGLang bootstrap room is in flight")
            for _ in range(_MAX_DRAWS):
                room = residue + ranks * (self._lane + self._lanes * secrets.randbelow(capacity))
                if room not in self._in_flight:
                    self._in_flight[room] = kind
                    self._taken[kind] = self._taken.get(kind, 0) + 1
                    return room
        raise ResourceExhausted("SGLang bootstrap rooms of this rank are nearly all in flight")

    def release(self, room: int) -> None:
        with self._lock:
            kind = self._in_flight.pop(room, None)
            if kind is not None:
                left = self._taken[kind] - 1
                if left:
                    self._taken[kind] = left
                else:
                    del self._taken[kind]

    def in_flight(self) -> int:
        return len(self._in_flight)


class SGLangDialect(Dialect):
    """Concurrent legs paired by a bootstrap room unique among in-flight requests."""

    engine = "sglang"
    checked_against = "SGLang main (2026 snapshot): bootstrap_host/port/room on the OpenAI routes"
    legs = Legs.CONCURRENT
    ranked = True
    handoff_keys = frozenset({BOOTSTRAP_HOST, BOOTSTRAP_PORT, BOOTSTRAP_ROOM, ROUTED_DP_RANK,
                              DISAGG_PREFILL_DP_RANK})
    pd_routes = OPENAI_ROUTES | {Route.RESPONSES, Route.MESSAGES}
    unserved_routes = frozenset({Route.GENERATE})
    #: SGLang's ``/v1/tokenize`` takes a completions ``prompt`` only.
    tokenize = TokenizeEndpoint("/v1/tokenize", chat=False)
    Options = SGLangOptions
    ids_text = IdsText("/v1/detokenize", ids_field="tokens", text_field="text",
                       extra=MappingProxyType({"skip_special_tokens": True}))

    def token_ids(self, route: Route) -> TokenIdPlaces | None:
        return COMPLETIONS_IDS if route is Route.COMPLETIONS else None

    def continuation_refusal(self, route: Route, body: Mapping[str, Any]) -> str | None:
        return refusal(route, body)

    def continuation(self, route: Route, body: Mapping[str, Any], prompt_ids: list[int],
                     ids: list[int]) -> tuple[Route, dict[str, Any]]:
        return continuation_body(route, body, prompt_ids, ids, COMPLETIONS_IDS)

    def __init__(self, setup: DialectSetup) -> None:
        super().__init__(setup)
        self.bootstrap_port = SGLangOptions.of(setup.settings).sglang_bootstrap_port
        self.rooms = RoomAllocator(lane=setup.lane, lanes=setup.lanes)
        #: The gRPC front door's rooms: int32, as SGLang's own gRPC path carries them.
        self.grpc_rooms = self.rooms.narrowed(INT32_ROOMS)

    def begin(self, ctx: HandoffContext) -> HandoffContext:
        grpc = ctx.front_door is FrontDoor.GRPC
        rooms = self.grpc_rooms if grpc else self.rooms
        if ctx.prefill_rank is None:
            return ctx.with_state(rooms.allocate())
        # The prefill engine is this pod's over gRPC, the target's over HTTP.
        ranks = self.setup.local_ranks if grpc else self.setup.prefill_ranks
        return ctx.with_state(rooms.allocate(ctx.prefill_rank, ranks))

    def end(self, ctx: HandoffContext) -> None:
        if isinstance(ctx.state, int):
            self.rooms.release(ctx.state)

    def prefill_fields(self, ctx: HandoffContext) -> dict[str, Any]:
        fields = self._bootstrap_fields(ctx)
        if ctx.prefill_rank is not None:
            fields[ROUTED_DP_RANK] = ctx.prefill_rank
        return fields

    def handoff(
        self, prefill_response: Mapping[str, Any] | None, ctx: HandoffContext
    ) -> dict[str, Any]:
        # The decode leg is built before the prefill answers: same three values, same room.
        fields = self._bootstrap_fields(ctx)
        if ctx.prefill_rank is not None:
            fields[DISAGG_PREFILL_DP_RANK] = ctx.prefill_rank
        return fields

    def decode_body(
        self, client_body: Mapping[str, Any], handoff: Mapping[str, Any],
        rank: int | None = None,
    ) -> dict[str, Any]:
        body = merge_top_level(client_body, handoff)
        if rank is not None:
            body[ROUTED_DP_RANK] = rank
        return body

    def decode_failure_hint(self, ctx: HandoffContext) -> str | None:
        # A decode that cannot reach the prefill's bootstrap server fails its request with a
        # 5xx: the usual cause is a port the two sides do not agree on.
        return (
            f"an SGLang decode that fails at once usually could not meet its prefill: check "
            f"the bootstrap port, {self.bootstrap_port} sent (bootstrap_port, from this "
            "sidecar's --sglang-bootstrap-port or the pod annotation named by "
            "--sglang-bootstrap-port-annotation), against the prefill engine's "
            f"--disaggregation-bootstrap-port on {ctx.advertise_host}"
        )

    def _bootstrap_fields(self, ctx: HandoffContext) -> dict[str, Any]:
        room = ctx.state
        if not isinstance(room, int):
            raise SidecarError("SGLang request has no bootstrap room (begin not called)")
        fields: dict[str, Any] = {
            BOOTSTRAP_HOST: ctx.advertise_host,
            BOOTSTRAP_PORT: self.bootstrap_port,
            BOOTSTRAP_ROOM: room,
        }
        rid_field = RID_FIELDS.get(ctx.route, RID)
        if rid_field is not None:
            fields[rid_field] = route_rid(ctx, room)
        return fields

    def abort_call(self, ctx: HandoffContext) -> tuple[str, dict[str, Any]] | None:
        if not isinstance(ctx.state, int) or RID_FIELDS.get(ctx.route, RID) is None:
            return None
        return ABORT_PATH, {RID: route_rid(ctx, ctx.state)}


def route_rid(ctx: HandoffContext, room: int) -> str:
    """The engine's id of a request's legs on ``ctx.route``."""
    rid = request_rid(ctx.request_id, room)
    return RESPONSE_ID_PREFIX + rid if ctx.route is Route.RESPONSES else rid


def request_rid(request_id: str, room: int) -> str:
    """The engine-side id of a request's legs: unique among requests in flight (the room
    is), and carrying the client's request id for log correlation."""
    return f"{request_id}-{room}"
