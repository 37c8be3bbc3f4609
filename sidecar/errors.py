"""The closed error taxonomy: every failure the sidecar reports, with its HTTP status.

Each error has a stable ``code`` (what clients and metrics key on), the ``stage`` where it
happened, an HTTP status and a *safe* message: the sidecar's own, never an engine's body (it
may quote the prompt), never a traceback.

    raise PrefillFailed("prefill engine answered 500")
        -> HTTP 502 {"error": {"message": ..., "type": "prefill_error", "code": "prefill_failed"}}
        -> gRPC UNAVAILABLE (the gRPC door's mapping, ``sidecar.grpc_server.errors``)

Deliberate limit: imports no transport (``http_server.errors``, ``grpc_server.errors`` render).
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar


class Stage(StrEnum):
    """Where in a request's life an error happened."""

    REQUEST = "request"
    PREFILL = "prefill"
    HANDOFF = "handoff"
    DECODE = "decode"
    SIDECAR = "sidecar"


class SidecarError(Exception):
    """Base of every error the sidecar reports to a client."""

    code: ClassVar[str] = "internal_error"
    http_status: ClassVar[int] = 500
    default_stage: ClassVar[Stage] = Stage.SIDECAR

    def __init__(self, message: str, *, stage: Stage | None = None,
                 address: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.stage = stage or self.default_stage
        #: An address of a prefill target the message names: the log always shows it, a
        #: client's answer only when the router named that target (``without_address``).
        self.address = address
        #: An engine's own explanation of the failure (its error body's message), for the
        #: sidecar's decisions and logs: never a client's answer (it may quote the prompt).
        self.engine_reason: str | None = None

    def without_address(self, instead: str) -> SidecarError:
        """The same error with its address replaced by ``instead`` (for a client's answer
        about a target the router did not name)."""
        if self.address is None:
            return self
        hidden = type(self)(self.message.replace(self.address, instead), stage=self.stage)
        hidden.__dict__.update({k: v for k, v in self.__dict__.items()
                                if k not in ("message", "address", "args")})
        return hidden

    @property
    def error_type(self) -> str:
        """The OpenAI envelope's ``type``: the stage the error belongs to."""
        return f"{self.stage.value}_error"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, stage={self.stage.value!r})"


class InvalidRequest(SidecarError):
    """The client's request is malformed or asks for something unsupported (HTTP 400)."""

    code = "invalid_request"
    http_status = 400
    default_stage = Stage.REQUEST


class UnsupportedContentEncoding(InvalidRequest):
    """The body's ``Content-Encoding`` is none the sidecar decodes (HTTP 415): it never
    forwards bytes it cannot read nor a length it did not count."""

    code = "unsupported_content_encoding"
    http_status = 415


class TargetNotAllowed(SidecarError):
    """The named prefill target is not on the allowlist; nothing is sent to it (HTTP 403)."""

    code = "prefill_target_not_allowed"
    http_status = 403
    default_stage = Stage.REQUEST


class RouteNotServed(SidecarError):
    """A prefill target was named on a route the local engine does not serve (HTTP 404)."""

    code = "route_not_served"
    http_status = 404
    default_stage = Stage.REQUEST


class BodyTooLarge(SidecarError):
    """The request body exceeds the configured cap (HTTP 413)."""

    code = "body_too_large"
    http_status = 413
    default_stage = Stage.REQUEST


class RequestTimeout(SidecarError):
    """The client did not send its whole request in time (slow or stalled upload; HTTP 408)."""

    code = "request_timeout"
    http_status = 408
    default_stage = Stage.REQUEST


class PrefillFailed(SidecarError):
    """The prefill engine failed, was unreachable or answered garbage (HTTP 502)."""

    code = "prefill_failed"
    http_status = 502
    default_stage = Stage.PREFILL
    #: The failure shows the engine unhealthy (5xx, reset, garbage, unreachable); False for
    #: an answer about the request itself (a 4xx) or a busy engine (429). Targets' circuit
    #: breakers count only the former.
    engine_fault: bool = True


class PrefillNotRun(PrefillFailed):
    """The prefill engine provably did no work on the request: the core may move it once to
    another target. The same code and statuses as ``PrefillFailed``."""


class PrefillUnreachable(PrefillNotRun):
    """The prefill engine refused the connection, or did not accept it in time: it never saw
    the request (retryable)."""


class PrefillBusy(PrefillNotRun):
    """The prefill engine answered 503 or 429, before any token (retryable)."""


class PrefillBreakerOpen(PrefillNotRun):
    """The target's circuit breaker is open: nothing was sent to it (retryable)."""


class PrefillMismatch(SidecarError):
    """No prefill target of the request can hand KV off to the local engine: each serves
    another model, or another KV layout, or does not say what it serves (HTTP 502); nothing
    was sent to one. Never a target's health: its circuit breaker does not count it."""

    code = "prefill_target_mismatch"
    http_status = 502
    default_stage = Stage.PREFILL


class EngineRejected(SidecarError):
    """An engine refused the request as invalid (it answered 4xx); the client must change it."""

    code = "engine_rejected_request"
    http_status = 400
    default_stage = Stage.DECODE


class InvalidHandoff(SidecarError):
    """The prefill answered, but without a usable hand-off for the decode engine (HTTP 502)."""

    code = "invalid_handoff"
    http_status = 502
    default_stage = Stage.HANDOFF


class DecodeFailed(SidecarError):
    """The decode engine failed, was unreachable or broke its stream (HTTP 502)."""

    code = "decode_failed"
    http_status = 502
    default_stage = Stage.DECODE
    #: The failure is the engine's (5xx, reset, garbage, a 5xx error event in its stream);
    #: False for an answer about the request (a 4xx such as 404 or 429): a migration
    #: (``sidecar.request.migration``) moves only the former.
    engine_fault: bool = True


class Overloaded(SidecarError):
    """More requests in flight than ``--max-inflight`` allows (HTTP 503, Retry-After)."""

    code = "overloaded"
    http_status = 503
    default_stage = Stage.SIDECAR


class Draining(SidecarError):
    """The sidecar is shutting down and takes no new requests (HTTP 503)."""

    code = "draining"
    http_status = 503
    default_stage = Stage.SIDECAR


class EngineNotReady(SidecarError):
    """The local engine does not answer (HTTP 503)."""

    code = "engine_not_ready"
    http_status = 503
    default_stage = Stage.DECODE


class DeadlineExceeded(SidecarError):
    """A leg's deadline passed (HTTP 504)."""

    code = "deadline_exceeded"
    http_status = 504
    default_stage = Stage.PREFILL


class ResourceExhausted(SidecarError):
    """A configured resource bound (staged KV bytes, block count) would be exceeded."""

    code = "resource_exhausted"
    http_status = 503
    default_stage = Stage.SIDECAR


class FailedPrecondition(SidecarError):
    """The request cannot run against this engine (e.g. KV blocks of another model)."""

    code = "failed_precondition"
    http_status = 400
    default_stage = Stage.HANDOFF


class ClientCancelled(SidecarError):
    """The client went away; both legs were cancelled (never rendered, only counted)."""

    code = "client_cancelled"
    http_status = 499
    default_stage = Stage.SIDECAR
