"""The TensorRT-LLM engine handler: context_only prefill, generation_only decode.

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

When the context response already finished (``answered_by_prefill``), the orchestrator returns
it as the answer, without its ``disaggregated_params`` (``prefill_answer``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from sidecar.engines.base import EngineHandler
from sidecar.errors import InvalidHandoff, SidecarError
from sidecar.ids import IdSources
from sidecar.protocol.context import HandoffContext, Route

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


class TRTLLMHandler(EngineHandler):
    """Sequential legs keyed by a snowflake ``disagg_request_id``."""

    name = "trtllm"
    drops_max_completion_tokens = True
    checked_against = (
        "TensorRT-LLM main (2026 snapshot): openai_disagg_service ctx-first flow, "
        "openai_protocol CompletionResponse.prompt_token_ids"
    )

    handoff_keys = frozenset({DISAGGREGATED_PARAMS})
    #: TRT-LLM's ``CompletionRequest.detokenize``: false streams token ids and empty text (its
    #: request models forbid unknown keys, so it gets only this one).
    token_id_fields = MappingProxyType({"detokenize": False})

    def assign_ids(self, ctx: HandoffContext, ids: IdSources) -> HandoffContext:
        return ctx.with_ids(trtllm_disagg_request_id=ids.snowflake.next())

    def prefill_fields(self, ctx: HandoffContext) -> dict[str, Any]:
        if ctx.trtllm_disagg_request_id is None:
            raise SidecarError("TRT-LLM request has no disagg request id (assign_ids not called)")
        return {
            DISAGGREGATED_PARAMS: {
                REQUEST_TYPE: CONTEXT_ONLY,
                DISAGG_REQUEST_ID: ctx.trtllm_disagg_request_id,
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
                f"{type(params).__name__}, expected an object"
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
        """The context answer without engine hand-off state: TensorRT-LLM's own disaggregated
        server drops ``disaggregated_params`` from a context response it returns as the answer.
        """
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
