"""A streamed answer read back, and continued in its API's shape: what a migration
(``sidecar.request.migration``) needs of the stream a client has received, and how a
continuation's chunks reach that client as if one engine had written them all.

    places = dialect.token_ids(route)       where an engine's stream carries token ids, once
                                            the request asks (``TokenIdPlaces``)
    strip = ids_stripper(places)            bytes ─▶ the same bytes as an engine writes them
                                            when not asked (the client did not ask)
    so_far = read_stream(route, events, places, body)   what the client has: the prompt's
                                            ids, the answer's ids and text, its identity
    join = Join(route, continued, so_far, ...)
    join.event(payload) ─▶ bytes            one continuation event as the client's stream
                                            would have carried it (b"": nothing to send)

Which APIs can be read back: the completions and chat streams, and token-in generate (ids
always; text when asked); their chunks carry the ids (``choices[i]``) and the first one the
prompt's (or, token-in, the request does). The Responses and Messages streams carry no ids on
any engine here: they are never continued.

The join keeps the client's one stream: its id, ``created`` and model on every chunk; the
text and ids the continuation regenerates (``skip_text``, ``skip_ids``: the tail a
continuation recomputes to start at a character boundary) left out once, checked equal (a
continuation that says otherwise ``diverged``); ids the client did not ask for written as the
engine writes them unasked; usage counted over the whole answer once (the prompt the client
sent, every token of the answer; the prompt's cache figures by the usage rule of
``sidecar.protocol.apis``: the prefill's in a pair, unknown after a whole run moved).

Deliberate limits: one choice per stream (``n`` above 1 is fanned out, never continued);
chunks whose delta carried more than text (reasoning, tool calls: the engine parsed the
answer) are noted (``SoFar.parsed``) for the caller to refuse, since a continuation's raw
text would not be parsed the same way.
"""

from __future__ import annotations

import functools
import re
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final

from sidecar import jsonutil
from sidecar.protocol.apis.base import USAGE, is_int, is_token_ids
from sidecar.protocol.context import Route
from sidecar.protocol.sse import DATA_FIELD, DONE_PAYLOAD, ERROR_KEY

CHOICES: Final = "choices"
TEXT: Final = "text"
DELTA: Final = "delta"
CONTENT: Final = "content"
ROLE: Final = "role"
FINISH_REASON: Final = "finish_reason"
STOP_REASON: Final = "stop_reason"
#: The identity of an OpenAI stream's chunks (every chunk carries them).
OPENAI_HEAD: Final = ("id", "object", "created", "model")
#: The identity of a token-in stream's chunks.
REQUEST_ID: Final = "request_id"
#: The token-in stream's spans of tokens by the weights that made them (``[start, end)``).
WEIGHT_VERSIONS: Final = "weight_versions"
PROMPT_TOKENS: Final = "prompt_tokens"
COMPLETION_TOKENS: Final = "completion_tokens"
TOTAL_TOKENS: Final = "total_tokens"
PROMPT_TOKENS_DETAILS: Final = "prompt_tokens_details"
CHAT_CHUNK: Final = "chat.completion.chunk"
#: The routes whose streams can be read back and continued (given an engine's ids).
CONTINUABLE: Final = frozenset({Route.COMPLETIONS, Route.CHAT, Route.GENERATE})


class PromptIds(StrEnum):
    """Where the prompt's token ids are, once asked."""

    #: ``choices[0][prompt_key]`` of the first chunk.
    CHOICE = "choice"
    #: ``prompt_key`` at the first chunk's top level.
    TOP = "top"
    #: The request's own ``prompt_key`` (a token-in route: the client sent them).
    REQUEST = "request"


@dataclass(frozen=True, slots=True)
class TokenIdPlaces:
    """Where an engine's stream on one route carries token ids once the request asks for them
    (a dialect's knowledge: ``Dialect.token_ids``)."""

    #: The request fields that ask (empty: the route always carries them).
    ask: Mapping[str, Any]
    #: The key of each choice's new ids in a chunk.
    ids_key: str
    #: The key of the prompt's ids (see ``prompt``).
    prompt_key: str
    prompt: PromptIds
    #: Unasked, the engine writes the keys as ``null`` (True) or leaves them out (False).
    unasked_null: bool = True
    #: How an event the engine writes only when asked reads once stripped (a chunk that
    #: carries nothing but ids), or None: every chunk is written either way.
    asked_only: bytes | None = None

    def asked_by(self, body: Mapping[str, Any]) -> bool:
        """True when ``body`` itself asks for the ids (the client sees them)."""
        # A loop, not all() over a generator: this runs on every streamed request.
        for key, value in self.ask.items():  # noqa: SIM110
            if body.get(key) != value:
                return False
        return True


def ids_stripper(places: TokenIdPlaces) -> Callable[[bytes], bytes]:
    """What turns whole events of an asked stream into the bytes the engine writes unasked:
    each id list (the answer's and the prompt's) ``null`` or gone, nothing else touched.

    An id list is digits and commas in brackets, and a key's quotes are never bare inside
    generated text (JSON escapes them), so one substitution per read is exact. Written
    ``null``, the two keys' common tail (``token_ids``) leads the pattern: the regular
    expression engine then searches for it as a literal, about a search's cost per read (a
    pattern led by the alternation costs five times as much).
    """
    keys = (places.prompt_key.encode(), places.ids_key.encode())
    alternation = b"|".join(re.escape(key) for key in keys)
    strip: Callable[[bytes], bytes]
    if places.unasked_null:
        tail = _common_tail(*keys)
        if tail and all(key == tail or key.endswith(tail) for key in keys):
            pattern = re.compile(re.escape(tail) + rb'":\[[0-9,\s]*\]')
            written = tail + b'":null'
            strip = functools.partial(pattern.sub, written)
        else:
            led = re.compile(rb'"(' + alternation + rb')":\[[0-9,\s]*\]')
            strip = functools.partial(led.sub, rb'"\1":null')
    else:
        gone = re.compile(rb',"(?:' + alternation + rb')":\[[0-9,\s]*\]')
        strip = functools.partial(gone.sub, b"")
    asked_only = places.asked_only
    if asked_only is None:
        return strip

    def strip_and_skip(data: bytes) -> bytes:
        data = strip(data)
        # ``find``, not ``in``: ``bytes.__contains__`` first tries its operand as an integer,
        # and formats and clears a TypeError on every call (this runs on every read).
        if data.find(asked_only) < 0:
            return data
        return b"".join(event for event in _events(data) if asked_only not in event)

    return strip_and_skip


def _events(data: bytes) -> list[bytes]:
    """Whole events, each with its blank line."""
    return [event + b"\n\n" for event in data.split(b"\n\n") if event]


def _common_tail(first: bytes, second: bytes) -> bytes:
    """The longest tail both keys end with that begins a key (after an underscore, or
    whole)."""
    size = 0
    while size < min(len(first), len(second)) and first[-1 - size] == second[-1 - size]:
        size += 1
    tail = first[len(first) - size:]
    for key in (first, second):
        if key != tail and not key[: len(key) - len(tail)].endswith(b"_"):
            return b""
    return tail


# -- reading the stream back ------------------------------------------------------------

#: Chunk ends a join may start at, the last first: a chunk carries one id or a few, so the
#: last 8 reach back past any character an engine holds unfinished.
JOIN_MARKS: Final = 8


@dataclass(slots=True)
class SoFar:
    """What a client has of a streamed answer (kept up to date as a continuation adds on)."""

    route: Route
    #: The prompt's token ids as the engine saw them (None: the stream did not say).
    prompt_ids: list[int] | None = None
    #: Every token id of the answer so far (including those whose text an engine held back).
    ids: list[int] = field(default_factory=list)
    #: The answer's text the client has.
    text: str = ""
    #: The identity every chunk carries (``id``, ``object``, ``created``, ``model``; token-in:
    #: ``request_id``).
    head: dict[str, Any] = field(default_factory=dict)
    #: A chat stream's last content chunk (the shape continued chunks take), else its first.
    template: dict[str, Any] | None = None
    #: A finish reason (or the usage chunk) arrived: the answer itself is whole.
    finished: bool = False
    #: A chat delta carried more than text (the engine parsed the answer: reasoning, tools).
    parsed: bool = False
    #: A choice other than the first appeared.
    several: bool = False
    #: The stream carried text (False: a token-in stream of ids only).
    has_text: bool = True
    #: Events the client got (0: none; a continuation then starts the answer afresh).
    events: int = 0
    #: The last ``JOIN_MARKS`` chunk ends that carried ids: (ids so far, length of the text
    #: so far). There the client's text is the engine's for those ids (special tokens left
    #: out, as the engine writes them), unless the engine held back the bytes of a character
    #: its last id had not finished: the places a continuation may start.
    marks: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=JOIN_MARKS))

    def mark(self) -> None:
        self.marks.append((len(self.ids), len(self.text)))


def data_payloads(events: bytes) -> Iterable[bytes]:
    """The ``data:`` payloads of whole SSE events, in order."""
    for line in events.split(b"\n"):
        if line.startswith(DATA_FIELD):
            yield line[len(DATA_FIELD):].strip()


def read_stream(route: Route, events: bytes, places: TokenIdPlaces,
                body: Mapping[str, Any]) -> SoFar:
    """What ``events`` (the engine's own bytes, whole events) gave the client of ``route``."""
    so_far = SoFar(route)
    if places.prompt is PromptIds.REQUEST:
        ids = body.get(places.prompt_key)
        so_far.prompt_ids = list(ids) if isinstance(ids, list) and is_token_ids(ids) else None
    first = True
    for payload in data_payloads(events):
        if payload == DONE_PAYLOAD:
            so_far.finished = True
            continue
        try:
            chunk = jsonutil.loads(payload)
        except jsonutil.JSONDecodeError:
            continue
        if not isinstance(chunk, dict) or ERROR_KEY in chunk:
            continue
        note_chunk(so_far, chunk, places, first=first)
        first = False
    return so_far


def note_chunk(so_far: SoFar, chunk: dict[str, Any], places: TokenIdPlaces, *,
               first: bool) -> None:
    """Add one chunk the client received to ``so_far``."""
    route = so_far.route
    so_far.events += 1
    if first:
        keys = (REQUEST_ID,) if route is Route.GENERATE else OPENAI_HEAD
        so_far.head = {key: chunk[key] for key in keys if key in chunk}
        if places.prompt is PromptIds.TOP:
            so_far.prompt_ids = _ids(chunk.get(places.prompt_key))
        if route is Route.CHAT:
            so_far.template = chunk
    choices = chunk.get(CHOICES)
    if isinstance(chunk.get(USAGE), Mapping) and not choices:
        so_far.finished = True
    if not isinstance(choices, list):
        return
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("index", 0) != 0:
            so_far.several = True
            continue
        if first and places.prompt is PromptIds.CHOICE:
            so_far.prompt_ids = _ids(choice.get(places.prompt_key))
        ids = _ids(choice.get(places.ids_key)) or []
        so_far.ids += ids
        if choice.get(FINISH_REASON) is not None:
            so_far.finished = True
        if route is Route.CHAT:
            delta = choice.get(DELTA)
            if isinstance(delta, Mapping):
                content = delta.get(CONTENT)
                if isinstance(content, str):
                    so_far.text += content
                    if CONTENT in delta and ROLE not in delta:
                        so_far.template = chunk
                if any(value for key, value in delta.items() if key not in (ROLE, CONTENT)):
                    so_far.parsed = True
        else:
            text = choice.get(TEXT)
            if isinstance(text, str):
                so_far.text += text
            elif route is Route.GENERATE and TEXT not in choice:
                so_far.has_text = False
        if ids:
            so_far.mark()


def _ids(value: object) -> list[int] | None:
    return list(value) if isinstance(value, list) and is_token_ids(value) else None


# -- the continuation, as the client's stream -------------------------------------------


class Diverged(Exception):
    """A continuation's output differs from the answer it was to regenerate."""


@dataclass(slots=True)
class Join:
    """One continuation's events, written as ``so_far``'s client stream (see the module
    docstring); ``so_far`` is kept up to date with what the client gets."""

    so_far: SoFar
    #: The route the continuation runs on (its chunks' shape).
    continued: Route
    places: TokenIdPlaces
    #: The client asked for the ids itself (it sees them).
    asked: bool
    #: Answer tokens before the continuation's first (its usage counts from there).
    produced: int
    #: The text and ids the continuation regenerates that the client has already.
    skip_text: str = ""
    skip_ids: list[int] = field(default_factory=list)
    #: Tell usage: ``details(usage)`` the prompt's cache figures the client is told (the
    #: usage rule), or None to leave what the continuation says.
    details: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    #: The client got no event before: the continuation is the client's request run again
    #: whole, relayed as its engine writes it (``strip``: the ids it did not ask for, as an
    #: engine writes them unasked).
    fresh: bool = False
    strip: Callable[[bytes], bytes] | None = None
    _ids_seen: int = 0

    def event(self, payload: bytes) -> bytes:
        """The client's bytes for one continuation event's ``data:`` payload."""
        if payload == DONE_PAYLOAD:
            self.so_far.finished = True
            return DATA_FIELD + b" " + DONE_PAYLOAD + b"\n\n"
        chunk = jsonutil.loads(payload)
        if not isinstance(chunk, dict):
            raise Diverged("a continuation event is not a JSON object")
        if self.fresh:
            note_chunk(self.so_far, chunk, self.places, first=self.so_far.events == 0)
            event = DATA_FIELD + b" " + payload + b"\n\n"
            return self.strip(event) if self.strip is not None else event
        out = self.chunk(chunk)
        return b"" if out is None else DATA_FIELD + b" " + jsonutil.dumps(out) + b"\n\n"

    def chunk(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """One continuation chunk as the client's (None: all of it was the client's already)."""
        usage = chunk.get(USAGE)
        if isinstance(usage, dict):
            chunk[USAGE] = self._usage(usage)
        choices = chunk.get(CHOICES)
        choice = choices[0] if isinstance(choices, list) and choices else None
        if not isinstance(choice, dict):
            return self._shaped(chunk, None, None, None)
        ids = self._new_ids(_ids(choice.get(self.places.ids_key)) or [])
        text = choice.get(TEXT)
        text = self._new_text(text) if isinstance(text, str) else None
        finish = choice.get(FINISH_REASON)
        if not ids and not text and finish is None and not isinstance(usage, dict):
            return None  # regenerated, already the client's
        if ids:
            self.so_far.ids += ids
        if text:
            self.so_far.text += text
        if ids and not self.skip_text:  # past what it regenerates: the client's text again
            self.so_far.mark()
        if finish is not None:
            self.so_far.finished = True
        return self._shaped(chunk, choice, ids, text)

    def _new_ids(self, ids: list[int]) -> list[int]:
        """``ids`` without the ones the client has (checked against them)."""
        skip = self.skip_ids
        start = self._ids_seen
        if start >= len(skip):
            return ids
        take = min(len(ids), len(skip) - start)
        if ids[:take] != skip[start:start + take]:
            raise Diverged("the continuation's tokens differ from the answer's")
        self._ids_seen = start + take
        return ids[take:]

    def _new_text(self, text: str) -> str:
        """``text`` without what the client has (checked against it)."""
        skip = self.skip_text
        if not skip:
            return text
        take = min(len(text), len(skip))
        if text[:take] != skip[:take]:
            raise Diverged("the continuation's text differs from the answer's")
        self.skip_text = skip[take:]
        return text[take:]

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The continuation's usage as the whole answer's: the client's prompt, every token of
        the answer, the prompt's cache figures by the usage rule."""
        prompt = self.so_far.prompt_ids
        told = dict(usage)
        continued = usage.get(COMPLETION_TOKENS)
        if prompt is not None and PROMPT_TOKENS in told:
            told[PROMPT_TOKENS] = len(prompt)
        if is_int(continued):
            told[COMPLETION_TOKENS] = self.produced + continued
        if is_int(told.get(PROMPT_TOKENS)) and is_int(told.get(COMPLETION_TOKENS)) and (
                TOTAL_TOKENS in told):
            told[TOTAL_TOKENS] = told[PROMPT_TOKENS] + told[COMPLETION_TOKENS]
        if self.details is not None:
            told = self.details(told)
        return told

    def _shaped(self, chunk: dict[str, Any], choice: dict[str, Any] | None,
                ids: list[int] | None, text: str | None) -> dict[str, Any]:
        """``chunk`` in the client's route's shape, with the client's identity."""
        route = self.so_far.route
        if route is Route.CHAT and self.continued is not Route.CHAT:
            return self._as_chat(chunk, choice, ids, text)
        chunk.update(self.so_far.head)
        places = self.places
        if places.prompt is PromptIds.TOP and places.prompt_key in chunk:
            chunk[places.prompt_key] = None
        if choice is not None:
            if TEXT in choice and text is not None:
                choice[TEXT] = text
            self._set_ids(choice, ids)
            if places.prompt is PromptIds.CHOICE:
                self._unasked(choice, places.prompt_key)
            versions = choice.get(WEIGHT_VERSIONS)
            if isinstance(versions, list):
                choice[WEIGHT_VERSIONS] = self._shifted(versions)
        return chunk

    def _set_ids(self, choice: dict[str, Any], ids: list[int] | None) -> None:
        key = self.places.ids_key
        if self.asked or not self.places.ask:
            choice[key] = ids or []
        else:
            self._unasked(choice, key)

    def _unasked(self, holder: dict[str, Any], key: str) -> None:
        """``key`` as an engine writes it in a chunk that does not carry it."""
        if self.places.unasked_null:
            if key in holder:
                holder[key] = None
        else:
            holder.pop(key, None)

    def _shifted(self, versions: list[Any]) -> list[Any]:
        """Spans of the continuation's tokens as spans of the answer's: moved past the tokens
        before it, the first reaching back to the answer's start."""
        out = []
        for index, span in enumerate(versions):
            if not isinstance(span, dict):
                out.append(span)
                continue
            moved = dict(span)
            for key in ("start", "end"):
                if is_int(moved.get(key)):
                    moved[key] += self.produced
            if index == 0 and is_int(moved.get("start")):
                moved["start"] = 0
            out.append(moved)
        return out

    def _as_chat(self, chunk: dict[str, Any], choice: dict[str, Any] | None,
                 ids: list[int] | None, text: str | None) -> dict[str, Any]:
        """A completions continuation's chunk as a chat chunk of the client's stream."""
        head = self.so_far.head
        out: dict[str, Any] = dict(head)
        out["object"] = head.get("object", CHAT_CHUNK)
        if choice is None:
            out[CHOICES] = chunk.get(CHOICES, [])
            for key, value in chunk.items():
                if key not in out:
                    out[key] = value
            return out
        template = self._template_choice()
        shaped: dict[str, Any] = {}
        for key, value in template.items():
            if key == DELTA:
                shaped[DELTA] = {CONTENT: text or ""}
            elif key == FINISH_REASON:
                finish = choice.get(FINISH_REASON)
                shaped[FINISH_REASON] = finish
                if finish is not None and STOP_REASON in choice:
                    shaped[STOP_REASON] = choice[STOP_REASON]
            elif key != STOP_REASON:
                shaped[key] = value
        self._set_ids(shaped, ids)
        out[CHOICES] = [shaped]
        return out

    def _template_choice(self) -> dict[str, Any]:
        """The shape of a chat content chunk's choice, from the client's stream."""
        template = self.so_far.template
        choices = template.get(CHOICES) if template is not None else None
        choice = choices[0] if isinstance(choices, list) and choices else None
        base: dict[str, Any] = {"index": 0, DELTA: {}, "logprobs": None, FINISH_REASON: None}
        if isinstance(choice, dict):
            base = dict(choice)
            base.setdefault(FINISH_REASON, None)
        if self.places.ask and self.places.unasked_null:
            base.setdefault(self.places.ids_key, None)
        return base


def engine_fault_event(event: bytes) -> bool:
    """True when an engine's error event (``data: {"error": ...}``) reports a failure of its
    own (a 5xx code, or none), not one of the request (a 4xx)."""
    for payload in data_payloads(event):
        try:
            document = jsonutil.loads(payload)
        except jsonutil.JSONDecodeError:
            return True
        error = document.get(ERROR_KEY) if isinstance(document, dict) else None
        code = error.get("code") if isinstance(error, dict) else None
        if isinstance(code, str) and code.isdigit():
            code = int(code)
        return not (is_int(code) and 400 <= code < 500)
    return True
