"""What one HTTP API's module declares: its own rules, whatever engine serves it.

    api = api_of(route)                   (``sidecar.protocol.apis``)
    api.check(body)                       the fields the sidecar acts on (400 otherwise)
    api.prefill_base(body)                the prefill leg before any engine's hand-off fields:
                                          one output token in the API's own limit field, not
                                          streamed, nothing the prefill must not keep
    api.runs_whole(body)                  why the request must run whole on the local engine
                                          (state that lives on one engine), or None
    api.markers                           its stream's markers (``StreamMarkers``)
    api.true_usage(decode, prefill)       the usage rule: what the client is told
    (docs/driving/routes.md)
    api.answer_with_true_usage(...)       the same, on a JSON answer / on a stream event
    api.error_body(error)                 its error shape, before the first byte
    api.stream_error(error, last_event)   its error event, after the first byte

The usage rule (docs/driving/routes.md, "Usage"): counts of prompt tokens and of output from the
decode leg;
what the prompt's cache did (read and written tokens) from the prefill leg's own answer,
since the decode engine counts the transferred KV as cached (or not at all) and never saw
the client's cache; details the prefill did not report are not reported.

Engine knowledge never appears here: where an engine's hand-off goes is its dialect's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from sidecar import jsonutil
from sidecar.errors import SidecarError
from sidecar.protocol.context import Route
from sidecar.protocol.sse import DATA, OPENAI_STREAM, StreamMarkers

STREAM = "stream"
STREAM_OPTIONS = "stream_options"
USAGE = "usage"
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
        """The usage the client is told: ``decode``'s counts, ``prefill``'s cache figures."""
        raise NotImplementedError

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
        usage = payload.get(USAGE)
        if not isinstance(usage, Mapping):
            return False
        merged = self.true_usage(usage, prefill_usage)
        if merged == usage:
            return False
        payload[USAGE] = merged
        return True

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
