"""The two upstream calls of a PD request, with their deadlines and error mapping.

    post_prefill()  ─▶ dict (the prefill engine's JSON answer, size-capped, deadline-bound)
    open_decode()   ─▶ UpstreamResponse (head arrived, body not read; caller releases)

Errors map to the taxonomy: a refused connect -> PrefillUnreachable (a retryable
PrefillFailed) / EngineNotReady, 400/413/422 -> EngineRejected, other statuses, breaks or
garbage -> PrefillFailed / DecodeFailed, deadlines -> DeadlineExceeded. Engine error bodies
are read (to free the connection), never relayed: they may quote the prompt. The engine's
HTTP status goes on the leg span.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sidecar import jsonutil
from sidecar.errors import (
    DeadlineExceeded,
    DecodeFailed,
    EngineNotReady,
    EngineRejected,
    PrefillFailed,
    PrefillUnreachable,
    SidecarError,
    Stage,
)
from sidecar.http1 import EngineClient, UpstreamConnectError, UpstreamError, UpstreamResponse
from sidecar.observability.tracing import HTTP_STATUS, NOOP_SPAN, LegSpan

_MAX_ERROR_BODY = 64 * 1024


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
_CLIENT_FAULT_STATUSES = frozenset({400, 413, 422})


def _status_error(status: int, stage: Stage) -> SidecarError:
    name = stage.value
    if status in _CLIENT_FAULT_STATUSES:
        return EngineRejected(f"{name} engine rejected the request (HTTP {status})", stage=stage)
    failed: type[SidecarError] = PrefillFailed if stage is Stage.PREFILL else DecodeFailed
    return failed(f"{name} engine answered HTTP {status}", stage=stage)


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
) -> dict[str, Any]:
    """POST the prefill body and return its JSON object answer (``server_hostname``: the
    name an https target's certificate must carry when ``url`` names its address)."""
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
                await _drain_error_body(response)
                raise _status_error(response.status, Stage.PREFILL)
            raw = await read_capped(response, max_bytes)
        finally:
            response.release()
    except TimeoutError:
        raise DeadlineExceeded(
            f"prefill leg exceeded its {timeout_s:g} s deadline", stage=Stage.PREFILL
        ) from None
    except UpstreamConnectError as exc:
        # No connection, so not one byte of the request reached the engine: safe to retry.
        raise PrefillUnreachable(f"prefill engine unreachable or broke the connection: "
                                 f"{type(exc).__name__}") from None
    except UpstreamError as exc:
        raise PrefillFailed(f"prefill engine unreachable or broke the connection: "
                            f"{type(exc).__name__}") from None
    try:
        answer = jsonutil.loads(raw)
    except jsonutil.JSONDecodeError:
        raise PrefillFailed("prefill engine answered malformed JSON") from None
    if not isinstance(answer, dict):
        raise PrefillFailed("prefill engine answered JSON that is not an object")
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
    except UpstreamConnectError:
        raise EngineNotReady("local engine refused the connection", stage=Stage.DECODE) from None
    except TimeoutError:
        raise DeadlineExceeded("decode engine did not answer in time", stage=Stage.DECODE) from None
    except UpstreamError as exc:
        raise DecodeFailed(
            f"decode engine broke the connection: {type(exc).__name__}", stage=Stage.DECODE
        ) from None
    if span.recording:
        span.set(HTTP_STATUS, response.status)
    if response.status != 200:
        try:
            await _drain_error_body(response)
        finally:
            response.release()
        raise _status_error(response.status, Stage.DECODE)
    return response


async def _drain_error_body(response: UpstreamResponse) -> None:
    """Read (and drop) a bounded error body so the connection can be reused."""
    try:
        await response.read(_MAX_ERROR_BODY)
    except (UpstreamError, TimeoutError):
        response.close()
