"""What a failed engine call is, in the error taxonomy and in words (``sidecar.engines.calls``
makes the calls; only a failure comes here).

    status_error(status, stage, who, body)   an engine's non-200 answer
    connect_failure(exc, who) / broken_connection(exc, who)   a connection's failure, in words
    engine_reason(body)                      an engine's own explanation, cleaned
    for_client(error, router_named, ...)     an error as the client may see it (addresses)

Errors map to the taxonomy: unreachable -> PrefillUnreachable (refused, or not accepted
within the connect timeout: the engine never saw the request) / EngineNotReady, a failed TLS
handshake -> PrefillFailed/DecodeFailed (its own message: the verification error), 4xx ->
EngineRejected, 5xx or garbage -> PrefillFailed/DecodeFailed, deadlines -> DeadlineExceeded.
Messages say what happened in words and name the engine as the caller says (``who``: a
router-named prefill target by its address); never an exception class.
An engine's 4xx answer is about the client's own request (a prompt over the context length,
a bad parameter): its reason is relayed (the engine's error message, cut to 4 KiB, control
characters removed, after the leg that answered). 5xx bodies are read (to free the
connection) but never relayed: their reason is kept on the error (``engine_reason``) for the
sidecar's own decisions (a dialect telling a stale hand-off from another failure) and logs.
"""

from __future__ import annotations

import logging
from typing import Any

from sidecar import jsonutil
from sidecar.errors import (
    DecodeFailed,
    EngineRejected,
    PrefillBusy,
    PrefillFailed,
    SidecarError,
    Stage,
)
from sidecar.http1 import (
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamResponse,
    UpstreamTLSError,
)

logger = logging.getLogger(__name__)

_MAX_ERROR_BODY = 64 * 1024
#: The most of an engine's 4xx reason a client sees (UTF-8 bytes).
MAX_REASON_BYTES = 4096
#: C0 and C1 controls and DEL: a relayed reason must not move a terminal's cursor or split a
#: log line. Tabs and line breaks become spaces; the rest is dropped.
_CONTROLS: dict[int, str | None] = {code: None for code in (*range(0x20), *range(0x7F, 0xA0))}
_CONTROLS.update({ord("\t"): " ", ord("\n"): " ", ord("\r"): " "})
#: How the messages name the local engine (the decode leg's, and any other local call).
LOCAL_ENGINE = "local engine"
DECODE_ENGINE = "decode engine"






#: Engine statuses that mean "this request is invalid": the client must change it.
_CLIENT_FAULT_STATUSES = frozenset({400, 413, 415, 422})
#: Prefill statuses of an engine that took the request in no further (overloaded, not
#: ready): the prefill did no work.
_NOT_STARTED_STATUSES = frozenset({429, 503})


def status_error(status: int, stage: Stage, who: str, body: bytes = b"") -> SidecarError:
    client_side = 400 <= status < 500
    reason = engine_reason(body)
    said = f": {reason}" if reason and client_side else ""
    error: SidecarError
    if status in _CLIENT_FAULT_STATUSES:
        error = EngineRejected(f"{who} rejected the request (HTTP {status}){said}", stage=stage)
    elif stage is not Stage.PREFILL:
        decode = DecodeFailed(f"{who} answered HTTP {status}{said}", stage=stage)
        decode.engine_fault = not client_side
        error = decode
    else:
        # A prefill answered 503/429 has not started (no token before the status line): it
        # may move to another target. 429 and other 4xx say nothing against the engine's
        # health.
        message = f"{who} answered HTTP {status}{said}"
        failed = (PrefillBusy(message) if status in _NOT_STARTED_STATUSES
                  else PrefillFailed(message))
        failed.engine_fault = not client_side
        error = failed
    error.engine_reason = reason
    return error


def engine_reason(body: bytes) -> str | None:
    """The engine's own explanation in a 4xx body, cleaned for a client (None: none).

    The OpenAI shape ``{"error": {"message"}}`` (vLLM, SGLang), ``{"message"}`` (their
    ``"object": "error"`` answers, TensorRT-LLM), FastAPI's ``{"detail"}`` (a string, or its
    validation errors' ``msg``), else the body as text.
    """
    text: str | None
    try:
        document = jsonutil.loads(body)
    except jsonutil.JSONDecodeError:
        text = body.decode("utf-8", "replace")
    else:
        text = _json_reason(document)
    if not text:
        return None
    cleaned = " ".join(text.translate(_CONTROLS).split())
    cut = cleaned.encode()[:MAX_REASON_BYTES].decode("utf-8", "ignore")
    return cut or None


def _json_reason(document: Any) -> str | None:
    if isinstance(document, str):
        return document
    if not isinstance(document, dict):
        return None
    error = document.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    for key in ("message", "error", "detail"):
        value = document.get(key)
        if isinstance(value, str):
            return value
    detail = document.get("detail")
    if isinstance(detail, list):
        messages = [str(item["msg"]) for item in detail
                    if isinstance(item, dict) and isinstance(item.get("msg"), str)]
        return "; ".join(messages) or None
    return None


def broken_connection(exc: UpstreamError, who: str) -> str:
    """What an upstream failure after the connect did, in words."""
    if isinstance(exc, UpstreamBroken):
        return f"{who} closed the connection before its answer was complete"
    if isinstance(exc, UpstreamProtocolError):
        return f"{who} answered something that is not HTTP/1.1 ({exc.reason})"
    return f"{who}: {exc.reason}"


def connect_failure(exc: UpstreamConnectError, who: str) -> str:
    """A connect that failed, in words (a TLS handshake names its verification error)."""
    if isinstance(exc, UpstreamTLSError):
        return f"TLS handshake with {who} failed: {exc.reason}"
    if exc.refused:
        return f"{who} refused the connection"
    return f"{who} unreachable: {exc.reason}"






def log_tls_failure(url: str, exc: UpstreamTLSError) -> None:
    """A handshake that failed is a configuration to fix: say where, and why (never at the
    level of a refused connection, which an engine restart explains)."""
    logger.warning("TLS handshake with %s failed: %s", url, exc.reason)


async def drain_error_body(response: UpstreamResponse) -> bytes:
    """Read a bounded error body, so the connection can be reused; what was read."""
    try:
        return await response.read(_MAX_ERROR_BODY)
    except (UpstreamError, TimeoutError):
        response.close()
        return b""


def for_client(error: SidecarError, router_named: bool, request_id: str) -> SidecarError:
    """An error that names a prefill target's address (a failed look-up): as it is for a
    target the router named; else logged whole and answered without the address (a static
    pool's addresses stay in the log)."""
    if error.address is None or router_named:
        return error
    logger.warning("request %s: %s", request_id, error.message)
    return error.without_address("the prefill engine (its address is in the sidecar's log)")
