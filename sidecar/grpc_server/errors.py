"""``SidecarError`` as a gRPC status: one place decides what a gRPC client sees.

    raise PrefillFailed("prefill engine answered HTTP 500")
        -> status UNAVAILABLE, details "prefill_failed (prefill): prefill engine answered HTTP 500"
           trailing metadata disagg-error-code: prefill_failed, disagg-error-stage: prefill

The status is the error's ``grpc_status`` (``sidecar.errors``); the details are the error's own
safe message (written by the sidecar, never an engine body), prefixed by its stable code and
stage so a router can tell a prefill failure from a decode failure without parsing text.

Deliberate limits: no rich status (``google.rpc.Status`` details); the two metadata keys carry
what a router needs.
"""

from __future__ import annotations

from typing import Any, Final, NoReturn

import grpc

from sidecar.errors import SidecarError

ERROR_CODE_KEY: Final = "disagg-error-code"
ERROR_STAGE_KEY: Final = "disagg-error-stage"


def status_details(error: SidecarError) -> str:
    """The status details a client sees for ``error``."""
    return f"{error.code} ({error.stage.value}): {error.message}"


async def abort_with(context: grpc.aio.ServicerContext[Any, Any], error: SidecarError) -> NoReturn:
    """End the RPC with ``error``'s status (raises, as ``context.abort`` does)."""
    await context.abort(
        error.grpc_status,
        status_details(error),
        trailing_metadata=((ERROR_CODE_KEY, error.code), (ERROR_STAGE_KEY, error.stage.value)),
    )
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises
