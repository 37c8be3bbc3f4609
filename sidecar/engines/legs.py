"""The two upstream calls of a PD request, with their deadlines and error mapping.

    post_prefill()  ─▶ dict (the prefill engine's JSON answer, size-capped, deadline-bound)
    open_decode()   ─▶ UpstreamResponse (head arrived, body not read; caller releases)

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
Each call names the engine's HTTP status on its leg span (``sidecar.observability.tracing``;
a no-op when tracing is off).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from sidecar import jsonutil
from sidecar.errors import (
    DeadlineExceeded,
    DecodeFailed,
    EngineNotReady,
    EngineRejected,
    PrefillBusy,
    PrefillFailed,
    PrefillUnreachable,
    SidecarError,
    Stage,
)
from sidecar.http1 import (
    EngineClient,
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamResponse,
    UpstreamTLSError,
)
from sidecar.observability.tracing import HTTP_STATUS, NOOP_SPAN, LegSpan

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


async def read_capped(response: UpstreamResponse, max_bytes: int) -> bytes:
    """The whole body, refusing more than ``max_bytes`` while reading."""
    length = response.content_length
    if length is not None and length > max_bytes:
        raise PrefillFailed(f"prefill response of {length} bytes exceeds the cap")
    raw = await response.read(max_bytes)
    if len(raw) > max_bytes:
        raise PrefillFailed("prefill response exceeds the size cap")
    return raw


def _json_headers(headers: Mapping[str, str]) -> list[tuple[str, str]]:
    """``headers`` with the body's own Content-Type (a client's would be a second one)."""
    out = [(name, value) for name, value in headers.items() if name.lower() != "content-type"]
    out.append(("Content-Type", "application/json"))
    return out


#: Engine statuses that mean "this request is invalid": the client must change it.
_CLIENT_FAULT_STATUSES = frozenset({400, 413, 415, 422})
#: Prefill statuses of an engine that took the request in no further (overloaded, not
#: ready): the prefill did no work.
_NOT_STARTED_STATUSES = frozenset({429, 503})


def _status_error(status: int, stage: Stage, who: str, body: bytes = b"") -> SidecarError:
    client_side = 400 <= status < 500
    reason = engine_reason(body)
    said = f": {reason}" if reason and client_side else ""
    error: SidecarError
    if status in _CLIENT_FAULT_STATUSES:
        error = EngineRejected(f"{who} rejected the request (HTTP {status}){said}", stage=stage)
    elif stage is not Stage.PREFILL:
        error = DecodeFailed(f"{who} answered HTTP {status}{said}", stage=stage)
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


async def post_prefill(
    session: EngineClient,
    url: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    *,
    timeout_s: float,
    max_bytes: int,
    server_hostname: str | None = None,
    span: LegSpan = NOOP_SPAN,
    who: str = "prefill engine",
) -> dict[str, Any]:
    """POST the prefill body and return its JSON object answer (``server_hostname``: the
    name an https target's certificate must carry when ``url`` names its address; ``who``:
    the engine as the messages name it)."""
    payload = jsonutil.dumps(body)
    try:
        response = await session.request(
            "POST", url, headers=_json_headers(headers), body=payload, timeout_s=timeout_s,
            server_hostname=server_hostname,
        )
        if span.recording:
            span.set(HTTP_STATUS, response.status)
        try:
            if response.status != 200:
                error_body = await _drain_error_body(response)
                raise _status_error(response.status, Stage.PREFILL, who, error_body)
            raw = await read_capped(response, max_bytes)
        finally:
            response.release()
    except TimeoutError:
        raise DeadlineExceeded(
            f"prefill leg exceeded its {timeout_s:g} s deadline", stage=Stage.PREFILL
        ) from None
    except UpstreamTLSError as exc:
        _log_tls_failure(url, exc)
        raise PrefillFailed(connect_failure(exc, who)) from None
    except UpstreamConnectError as exc:
        # No connection, so not one byte of the request reached the engine: safe to retry.
        raise PrefillUnreachable(connect_failure(exc, who)) from None
    except UpstreamError as exc:
        raise PrefillFailed(broken_connection(exc, who)) from None
    try:
        answer = jsonutil.loads(raw)
    except jsonutil.JSONDecodeError:
        raise PrefillFailed(f"{who} answered malformed JSON") from None
    if not isinstance(answer, dict):
        raise PrefillFailed(f"{who} answered JSON that is not an object")
    return answer


async def open_decode(
    session: EngineClient,
    url: str,
    body: Mapping[str, Any] | bytes,
    headers: Mapping[str, str],
    span: LegSpan = NOOP_SPAN,
) -> UpstreamResponse:
    """POST the decode body; return the response once its head arrived (status 200)."""
    payload = body if isinstance(body, bytes) else jsonutil.dumps(body)
    try:
        response = await session.request(
            "POST", url, headers=_json_headers(headers), body=payload
        )
    except UpstreamTLSError as exc:
        _log_tls_failure(url, exc)
        raise DecodeFailed(connect_failure(exc, LOCAL_ENGINE), stage=Stage.DECODE) from None
    except UpstreamConnectError as exc:
        raise EngineNotReady(connect_failure(exc, LOCAL_ENGINE), stage=Stage.DECODE) from None
    except TimeoutError:
        raise DeadlineExceeded("decode engine did not answer in time", stage=Stage.DECODE) from None
    except UpstreamError as exc:
        raise DecodeFailed(broken_connection(exc, DECODE_ENGINE), stage=Stage.DECODE) from None
    if span.recording:
        span.set(HTTP_STATUS, response.status)
    if response.status != 200:
        try:
            body = await _drain_error_body(response)
        finally:
            response.release()
        raise _status_error(response.status, Stage.DECODE, DECODE_ENGINE, body)
    return response


def _log_tls_failure(url: str, exc: UpstreamTLSError) -> None:
    """A handshake that failed is a configuration to fix: say where, and why (never at the
    level of a refused connection, which an engine restart explains)."""
    logger.warning("TLS handshake with %s failed: %s", url, exc.reason)


async def _drain_error_body(response: UpstreamResponse) -> bytes:
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
