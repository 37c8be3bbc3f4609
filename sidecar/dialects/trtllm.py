"""TensorRT-LLM: context_only prefill, generation_only decode, keyed by a snowflake id.

Follows TensorRT-LLM's own disaggregated server (``openai_disagg_service``, context-first):

    prefill body = common rules, no max_completion_tokens (TRT-LLM rejects it),
                   + disaggregated_params {"request_type": "context_only", "disagg_request_id": id}
    context response: disaggregated_params in choices[0] (current) or at the top level (older);
                      prompt_token_ids at the top level
    decode fields = {"disaggregated_params": <that object, request_type := "generation_only">,
                     "prompt": ids (completions) | "prompt_token_ids": ids (chat)}

TRT-LLM's request models forbid unknown fields, so nothing of our own is ever added; the
object from the context response is copied with only ``request_type`` changed (its other keys,
e.g. ``ctx_request_id``, ``encoded_opaque_state``, ``first_gen_tokens``, stay as they are).
Ids stay Python ints end to end, so values above 2**53 survive exactly.

Routes (TensorRT-LLM's worker server, ``serve/openai_server.py``): completions and chat are
pairs. The worker's Responses request has no ``disaggregated_params`` (its models forbid
unknown fields) and its Anthropic adapter builds the chat request from Anthropic fields only
(the hand-off would be dropped unannounced): both run whole on the local engine.
``/inference/v1/generate`` is not served: refused.

Migration (``sidecar.request.migration``): TensorRT-LLM streams token ids only with
``detokenize: false``, and then no text (``postprocess_handlers.py``: a completions choice's
``token_ids`` replace its ``text``; a chat chunk carries none), so a client's stream can never
be continued; a JSON answer whose engine died runs again on an engine ``--migration-url``
names (a context server cannot run a request whole).

When the context response already finished (``answered_by_prefill``), the core returns it as
the answer, without its ``disaggregated_params`` (``prefill_answer``).

Data parallelism (attention DP): TensorRT-LLM's OpenAI requests have no rank field; each
server's attention-DP balancer places a request, and the context server names its rank in
the answer (``disaggregated_params.ctx_dp_rank``), which the copy above carries to the
generation server. So the dialect is not ``ranked``: the sidecar names no rank.

The ``disagg_request_id`` (``SnowflakeIds``, docs/driving/handoffs.md#trtllm-snowflake):
``[timestamp 41b][machine 10b][counter 12b]``, folded into ``[2**42, 2**63-1)`` so TRT-LLM
treats it as a global (cross-worker) id. In a pool of workers the 12-bit counter runs
``lane, lane + N, lane + 2N, ...`` below ``N * (4096 // N)``: no two workers of one pod can
produce the same id, and every worker keeps the configured machine id (the pod's identity).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from pydantic import Field

from sidecar import jsonutil
from sidecar.dialects.base import Dialect, DialectOptions, DialectSetup, check_lane
from sidecar.errors import InvalidHandoff, SidecarError
from sidecar.protocol.context import HandoffContext, Route

TRT_MACHINE_ID_BITS = 10
TRT_MIN_GLOBAL_ID = 1 << 42
TRT_MAX_MACHINE_ID = (1 << TRT_MACHINE_ID_BITS) - 1
#: 2023-01-01T00:00:00Z in milliseconds: the snowflake epoch.
TRT_EPOCH_MS = 1_672_531_200_000
_TIMESTAMP_MAX = (1 << 41) - 1
_COUNTER_MASK = 0xFFF
_FOLD_MODULUS = (1 << 63) - 1 - TRT_MIN_GLOBAL_ID

DISAGGREGATED_PARAMS = "disaggregated_params"
REQUEST_TYPE = "request_type"
DISAGG_REQUEST_ID = "disagg_request_id"
CONTEXT_ONLY = "context_only"
GENERATION_ONLY = "generation_only"
PROMPT = "prompt"
PROMPT_TOKEN_IDS = "prompt_token_ids"
CHOICES = "choices"
FINISH_REASON = "finish_reason"

#: finish_reason values of a context response that still needs a generation leg.
_UNFINISHED = frozenset({"length", "not_finished"})


def validate_trt_machine_id(machine_id: int) -> None:
    """Raise ``ValueError`` unless ``machine_id`` fits the snowflake's 10-bit field."""
    if not 0 <= machine_id <= TRT_MAX_MACHINE_ID:
        raise ValueError(f"TRT-LLM machine id {machine_id} is outside 0..{TRT_MAX_MACHINE_ID}")


def snowflake_id(now_ms: int, machine_id: int, counter: int) -> int:
    """The disagg request id for one instant, machine and counter value (pure)."""
    timestamp = min(max(now_ms - TRT_EPOCH_MS, 0), _TIMESTAMP_MAX)
    raw = (timestamp << 22) | (machine_id << 12) | (counter & _COUNTER_MASK)
    return raw % _FOLD_MODULUS + TRT_MIN_GLOBAL_ID


class SnowflakeIds:
    """Disagg request ids for one machine id (the pod's: every worker keeps it) and one
    worker's lane of the 12-bit counter."""

    def __init__(
        self,
        machine_id: int,
        clock_ms: Callable[[], int] | None = None,
        *,
        lane: int = 0,
        lanes: int = 1,
    ) -> None:
        validate_trt_machine_id(machine_id)
        check_lane(lane, lanes, _COUNTER_MASK + 1)
        self._machine_id = machine_id
        self._clock_ms = clock_ms or (lambda: time.time_ns() // 1_000_000)
        self._lane = lane
        self._lanes = lanes
        #: How many counter values this lane owns: lane + lanes * step, step < _steps.
        self._steps = (_COUNTER_MASK + 1) // lanes
        self._step = 0
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            step = self._step
            self._step = (step + 1) % self._steps
        counter = self._lane + self._lanes * step
        return snowflake_id(self._clock_ms(), self._machine_id, counter)


class TRTLLMOptions(DialectOptions):
    """TensorRT-LLM's settings."""

    trtllm_machine_id: int = Field(
        default=0,
        ge=0,
        le=TRT_MAX_MACHINE_ID,
        description="TensorRT-LLM snowflake request-id machine id (0..1023), unique per pod.",
    )


def _first_choice(response: Mapping[str, Any]) -> Mapping[str, Any] | None:
    choices = response.get(CHOICES)
    if isinstance(choices, list) and choices and isinstance(choices[0], Mapping):
        return choices[0]
    return None


def _find_disaggregated_params(response: Mapping[str, Any]) -> object:
    """The context response's disaggregated_params: top level first, then choices[0]."""
    params = response.get(DISAGGREGATED_PARAMS)
    if params is not None:
        return params
    choice = _first_choice(response)
    return None if choice is None else choice.get(DISAGGREGATED_PARAMS)


class TRTLLMDialect(Dialect):
    """Sequential legs keyed by a snowflake ``disagg_request_id``."""

    engine = "trtllm"
    drops_max_completion_tokens = True
    checked_against = (
        "TensorRT-LLM main (2026 snapshot): openai_disagg_service ctx-first flow, "
        "openai_protocol CompletionResponse.prompt_token_ids"
    )

    handoff_keys = frozenset({DISAGGREGATED_PARAMS})
    unserved_routes = frozenset({Route.GENERATE})
    #: TRT-LLM's ``CompletionRequest.detokenize``: false streams token ids and empty text (its
    #: request models forbid unknown keys, so it gets only this one).
    token_id_fields = MappingProxyType({"detokenize": False})

    Options = TRTLLMOptions

    def __init__(self, setup: DialectSetup) -> None:
        super().__init__(setup)
        self.ids = SnowflakeIds(TRTLLMOptions.of(setup.settings).trtllm_machine_id,
                                lane=setup.lane, lanes=setup.lanes)

    def begin(self, ctx: HandoffContext) -> HandoffContext:
        return ctx.with_state(self.ids.next())

    def prefill_fields(self, ctx: HandoffContext) -> dict[str, Any]:
        if not isinstance(ctx.state, int):
            raise SidecarError("TRT-LLM request has no disagg request id (begin not called)")
        return {
            DISAGGREGATED_PARAMS: {
                REQUEST_TYPE: CONTEXT_ONLY,
                DISAGG_REQUEST_ID: ctx.state,
            }
        }

    def handoff(
        self, prefill_response: Mapping[str, Any] | None, ctx: HandoffContext
    ) -> dict[str, Any]:
        if prefill_response is None:
            raise InvalidHandoff("TRT-LLM context response is missing")
        params = _find_disaggregated_params(prefill_response)
        if params is None:
            # TRT-LLM runs the generation leg as a plain request then.
            return {}
        if not isinstance(params, Mapping):
            raise InvalidHandoff(
                f"TRT-LLM context response has disaggregated_params of type "
                f"{jsonutil.type_name(params)}, expected an object"
            )
        generation = dict(params)
        generation[REQUEST_TYPE] = GENERATION_ONLY
        fields: dict[str, Any] = {DISAGGREGATED_PARAMS: generation}
        token_ids = prefill_response.get(PROMPT_TOKEN_IDS)
        if token_ids is not None:
            if not isinstance(token_ids, list):
                raise InvalidHandoff("TRT-LLM context response has prompt_token_ids not a list")
            # The generation server then skips tokenization (TRT-LLM's own server does this).
            fields[PROMPT if ctx.route is Route.COMPLETIONS else PROMPT_TOKEN_IDS] = token_ids
        return fields

    def prefill_answer(self, prefill_response: Mapping[str, Any]) -> dict[str, Any]:
        """The context answer without ``disaggregated_params``, as TensorRT-LLM's own
        disaggregated server returns a context response that is the answer."""
        answer = {k: v for k, v in prefill_response.items() if k != DISAGGREGATED_PARAMS}
        choices = answer.get(CHOICES)
        if isinstance(choices, list):
            answer[CHOICES] = [
                {k: v for k, v in choice.items() if k != DISAGGREGATED_PARAMS}
                if isinstance(choice, dict) else choice
                for choice in choices
            ]
        return answer

    def answered_by_prefill(self, prefill_response: Mapping[str, Any]) -> bool:
        choice = _first_choice(prefill_response)
        if choice is None:
            return False
        reason = choice.get(FINISH_REASON)
        return reason is not None and reason not in _UNFINISHED
