"""What one HTTP API's module declares: its own rules, whatever engine serves it, and the
field checks and the usage rule they share.

    api = api_of(route)                   (``sidecar.protocol.apis``)
    api.check(body)                       the fields the sidecar acts on (400 otherwise)
    api.prefill_base(body)                the prefill leg before any engine's hand-off fields:
                                          one output token in the API's own limit field, not
                                          streamed, nothing the prefill must not keep
    api.runs_whole(body)                  why the request must run whole on the local engine
                                          (state that lives on one engine), or None
    api.markers                           its stream's markers (``StreamMarkers``)
    api.true_usage(decode, prefill)       the usage rule: what the client is told
    api.answer_with_true_usage(...)       the same, on a JSON answer / on a stream event
    api.error_body(error)                 its error shape, before the first byte
    api.stream_error(error, last_event)   its error event, after the first byte

The usage rule (docs/driving/routes.md, "Usage"), here once for every API and every relay
(JSON answers, streams, fanned-out requests): counts of prompt tokens and of output from the
decode leg; what the prompt's cache did (read and written tokens) from the prefill leg's own
answer, since the decode engine counts the transferred KV as cached (or not at all) and never
saw the client's cache; details the prefill did not report are not reported. The OpenAI
shapes and Responses keep the cache figures in one details object (``usage_details``:
``prompt_tokens_details``, ``input_tokens_details``), taken whole from the prefill; Messages
keeps them as counts beside ``input_tokens`` (its own ``true_usage``). Several prompts' details
add up key by key (``summed_details``).

Field checks name the field and its JSON type only (``jsonutil.type_name``), never a value (a
value may quote the prompt). Engine knowledge never appears here: where an engine's hand-off
goes is its dialect's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Final, TypeGuard

from sidecar import jsonutil
from sidecar.errors import InvalidRequest, SidecarError
from sidecar.jsonutil import type_name
from sidecar.protocol.context import Route
from sidecar.protocol.sse import DATA, OPENAI_STREAM, StreamMarkers

STREAM = "stream"
STREAM_OPTIONS = "stream_options"
USAGE = "usage"
#: Where the OpenAI shapes keep the prompt's cache figures.
PROMPT_TOKENS_DETAILS: Final = "prompt_tokens_details"
#: The prefill leg computes the prompt's KV and one token, nothing more.
PREFILL_MAX_TOKENS = 1


def openai_error(error: SidecarError) -> dict[str, Any]:
    """``{"error": {"message", "type", "code"}}``: ``type`` names the stage."""
    return {"error": {"message": error.message, "type": error.error_type, "code": error.code}}


class Api:
    """One HTTP API's rules (a module per API subclasses this; one instance per route)."""

    route: ClassVar[Route]
    markers: ClassVar[StreamMarkers] = OPENAI_STREAM
    #: Top-level keys the sidecar reads or rewrites: they must not occur twice.
    control_keys: ClassVar[frozenset[str]] = frozenset({STREAM})
    #: How the stream events whose usage is told start (None: any event carrying usage).
    usage_events: ClassVar[tuple[bytes, ...] | None] = None
    #: The usage key holding the prompt's cache figures, taken whole from the prefill.
    usage_details: ClassVar[str] = PROMPT_TOKENS_DETAILS

    # -- the client's body ------------------------------------------------------------------

    def check(self, body: dict[str, Any]) -> None:
        """Refuse (``InvalidRequest``) a body whose fields the sidecar acts on are wrong."""

    def streams(self, body: Mapping[str, Any]) -> bool:
        return body.get(STREAM) is True

    def choices(self, body: Mapping[str, Any]) -> int:
        """How many choices the body asks for (several: one PD pair each)."""
        return 1

    def batch(self, body: Mapping[str, Any]) -> list[Any] | None:
        """The prompts of a batched body (two or more: one PD pair each), else None."""
        return None

    def runs_whole(self, body: Mapping[str, Any]) -> str | None:
        """The body field naming state that lives on one engine, or None."""
        return None

    # -- the prefill leg --------------------------------------------------------------------

    def prefill_base(
        self, body: Mapping[str, Any], *, drop_max_completion_tokens: bool = False
    ) -> dict[str, Any]:
        """The client body as a prefill leg (before the engine's hand-off fields)."""
        raise NotImplementedError

    # -- usage ------------------------------------------------------------------------------

    def stream_has_usage(self, body: Mapping[str, Any]) -> bool:
        """True when the body's stream carries usage (the relay rewrites it then)."""
        return True

    def true_usage(self, decode: Mapping[str, Any],
                   prefill: Mapping[str, Any] | None) -> dict[str, Any]:
        """The usage the client is told: ``decode``'s counts, ``prefill``'s cache figures
        (its ``usage_details`` object whole, or none when the prefill reported none)."""
        key = self.usage_details
        merged = dict(decode)
        details = prefill.get(key) if prefill is not None else None
        if not isinstance(details, Mapping):
            details = None
        if details is not None or key in merged:
            merged[key] = None if details is None else dict(details)
        return merged

    def answer_with_true_usage(self, answer: Mapping[str, Any],
                               prefill_answer: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """A JSON answer with its usage told truly; None when nothing changes."""
        usage = answer.get(USAGE)
        if not isinstance(usage, Mapping):
            return None
        merged = self.true_usage(usage, usage_of(prefill_answer))
        if merged == usage:
            return None
        return {**answer, USAGE: merged}

    def event_with_true_usage(self, name: bytes | None, payload: dict[str, Any],
                              prefill_usage: Mapping[str, Any] | None) -> bool:
        """Rewrite the usage a stream event carries, in place; False when nothing changed.

        ``name`` is the event's ``event:`` name (None for unnamed events).
        """
        holder = self.usage_holder(name, payload)
        usage = holder.get(USAGE) if holder is not None else None
        if holder is None or not isinstance(usage, Mapping):
            return False
        merged = self.true_usage(usage, prefill_usage)
        if merged == usage:
            return False
        holder[USAGE] = merged
        return True

    def usage_holder(self, name: bytes | None, payload: dict[str, Any]) -> dict[str, Any] | None:
        """The object of a stream event that holds the usage told truly (None: none)."""
        return payload

    # -- errors -----------------------------------------------------------------------------

    def error_body(self, error: SidecarError) -> dict[str, Any]:
        """The JSON body of an error answered before the first byte."""
        return openai_error(error)

    def stream_error(self, error: SidecarError, last_event: bytes = b"") -> bytes:
        """The event ending a stream that broke after its first byte (no end marker)."""
        return DATA + jsonutil.dumps(openai_error(error)) + b"\n\n"


def usage_of(answer: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """An answer's top-level usage object (where every API puts it), or None."""
    if answer is None:
        return None
    usage = answer.get(USAGE)
    return usage if isinstance(usage, Mapping) else None


def is_int(value: object) -> TypeGuard[int]:
    # JSON true/false parse to bool, a subclass of int in Python.
    return isinstance(value, int) and not isinstance(value, bool)


def is_token_ids(value: list[Any]) -> bool:
    return all(is_int(item) for item in value)


def check_bool(body: Mapping[str, Any], key: str, where: str = "") -> None:
    """``body[key]`` is a boolean or null (or absent)."""
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequest(f"'{where}{key}' must be a boolean, got {type_name(value)}")


def check_int_or_null(body: Mapping[str, Any], keys: Iterable[str], where: str = "") -> None:
    """Each of ``keys`` in ``body`` is an integer or null (or absent)."""
    for key in keys:
        value = body.get(key)
        if value is not None and not is_int(value):
            raise InvalidRequest(
                f"'{where}{key}' must be an integer or null, got {type_name(value)}")


def check_string_or_null(body: Mapping[str, Any], key: str) -> None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise InvalidRequest(f"'{key}' must be a string or null, got {type_name(value)}")


def check_object_list(body: Mapping[str, Any], key: str) -> None:
    """``body[key]`` is a non-empty array of objects."""
    items = body.get(key)
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
        raise InvalidRequest(f"'{key}' must be a non-empty array of objects")


def summed_details(details: Iterable[object]) -> dict[str, Any] | None:
    """Several prompts' details as one: integers added key by key, other values the first
    prompt's; None when no prompt reported any."""
    merged: dict[str, Any] | None = None
    for item in details:
        if not isinstance(item, Mapping):
            continue
        if merged is None:
            merged = dict(item)
            continue
        for key, value in item.items():
            have = merged.get(key)
            if is_int(value) and (have is None or is_int(have)):
                merged[key] = (have or 0) + value
            elif key not in merged:
                merged[key] = value
    return merged
