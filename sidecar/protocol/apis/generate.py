"""Token ids in, token ids out (``POST /inference/v1/generate``, vLLM's scale-out route):
its prefill rules, body checks and usage.

    {"token_ids": [...], "sampling_params": {"max_tokens", "min_tokens", "n", ...},
     "stream", "stream_options", ...}
    prefill leg = the client body with sampling_params.max_tokens 1 (sampling_params made
                  when absent), no sampling_params.min_tokens, stream false, no
                  stream_options
    stream      = ``data:`` chunks of token ids, a usage chunk when asked, ``data: [DONE]``
                  (the OpenAI routes' markers); usage is OpenAI-shaped

``sampling_params.n`` above 1 is refused (400): the hand-off carries one sequence's KV and
the route's answers do not merge the way the OpenAI routes' choices do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from sidecar.errors import InvalidRequest
from sidecar.jsonutil import type_name
from sidecar.protocol.apis.base import (
    PREFILL_MAX_TOKENS,
    STREAM,
    STREAM_OPTIONS,
    Api,
    check_bool,
    check_int_or_null,
    is_token_ids,
)
from sidecar.protocol.apis.completions import asks_usage
from sidecar.protocol.context import Route

TOKEN_IDS: Final = "token_ids"
SAMPLING_PARAMS: Final = "sampling_params"
MAX_TOKENS: Final = "max_tokens"
MIN_TOKENS: Final = "min_tokens"
N: Final = "n"


class GenerateApi(Api):
    route = Route.GENERATE
    control_keys = frozenset({TOKEN_IDS, SAMPLING_PARAMS, STREAM, STREAM_OPTIONS})

    def check(self, body: dict[str, Any]) -> None:
        check_bool(body, STREAM)
        ids = body.get(TOKEN_IDS)
        if not isinstance(ids, list) or not ids or not is_token_ids(ids):
            raise InvalidRequest("'token_ids' must be a non-empty array of token ids")
        params = body.get(SAMPLING_PARAMS)
        if params is None:
            return
        if not isinstance(params, dict):
            raise InvalidRequest(
                f"'sampling_params' must be an object, got {type_name(params)}")
        check_int_or_null(params, (MAX_TOKENS, MIN_TOKENS, N), where="sampling_params.")
        n = params.get(N)
        if n is not None and n > 1:
            raise InvalidRequest(
                "'sampling_params.n' above 1 is not supported with a prefill target")

    def prefill_base(
        self, body: Mapping[str, Any], *, drop_max_completion_tokens: bool = False
    ) -> dict[str, Any]:
        prefill = dict(body)
        params = body.get(SAMPLING_PARAMS)
        sampling = dict(params) if isinstance(params, Mapping) else {}
        sampling[MAX_TOKENS] = PREFILL_MAX_TOKENS
        sampling.pop(MIN_TOKENS, None)
        prefill[SAMPLING_PARAMS] = sampling
        prefill[STREAM] = False
        prefill.pop(STREAM_OPTIONS, None)
        return prefill

    def stream_has_usage(self, body: Mapping[str, Any]) -> bool:
        return asks_usage(body)
