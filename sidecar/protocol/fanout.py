"""One OpenAI request of several prompts or choices, as single requests and back (pure).

    ClientRequest(batch, n) ─check_fanout()─▶ refusals (the cap, fields that cannot merge)
                            ─sub_bodies()──▶ one body per (prompt i, choice j), in order
                                              k = i * n + j (vLLM's and OpenAI's choice index)
    answers ─merge_answers()─▶ one answer: choices indexed k, one id, usage summed
    events  ─StreamMerger──▶ each leg's chunks with index k and one id; usage summed at the end

A sub-body is the client's with ``prompt`` := prompt i, ``n`` := 1 (when sent) and ``seed`` :=
``seed + j``; usage is summed as the engine counts it (prompt tokens once per prompt; each leg's
``prompt_tokens_details`` told by the usage rule first, added up once per prompt too). Every
shape, what is refused and why: docs/driving/request-shapes.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sidecar import jsonutil
from sidecar.errors import InvalidRequest
from sidecar.protocol.apis.base import PROMPT_TOKENS_DETAILS, summed_details
from sidecar.protocol.request import ClientRequest
from sidecar.protocol.sse import DATA, DATA_FIELD, DONE_PAYLOAD, sse_event

#: Leg k's usage as the client is told it (the usage rule), from what the leg reported.
TellUsage = Callable[[int, Mapping[str, Any]], Mapping[str, Any]]

_SEED_SPAN = 1 << 63
_USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "total_tokens")


def check_fanout(request: ClientRequest, max_fanout: int) -> None:
    """Refuse a fanned-out request the sidecar cannot answer as the engine would."""
    count = request.sub_requests
    if count > max_fanout:
        raise InvalidRequest(
            f"the request needs {count} prefill/decode pairs (prompts x n); the limit is "
            f"{max_fanout} (--max-fanout)"
        )
    body = request.body
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise InvalidRequest("'best_of' is not supported with n > 1 or batched prompts")
    if body.get("prompt_logprobs") is not None:
        raise InvalidRequest("'prompt_logprobs' is not supported with n > 1 or batched prompts")
    options = body.get("stream_options")
    if isinstance(options, Mapping) and options.get("continuous_usage_stats"):
        raise InvalidRequest(
            "'stream_options.continuous_usage_stats' is not supported with n > 1 or batched "
            "prompts"
        )


def derived_seed(seed: int, choice: int) -> int:
    """The seed of choice ``choice`` of a prompt (choice 0 keeps the client's)."""
    return (seed + choice) % _SEED_SPAN if choice else seed


def sub_bodies(request: ClientRequest) -> list[dict[str, Any]]:
    """One single-request body per (prompt, choice), in choice-index order."""
    body = request.body
    prompts: Sequence[Any] = request.batch if request.batch else (None,)
    seed = body.get("seed")
    bodies = []
    for prompt in prompts:
        for choice in range(request.n):
            sub = dict(body)
            if prompt is not None:
                sub["prompt"] = prompt
            if "n" in sub:
                sub["n"] = 1
            if isinstance(seed, int) and not isinstance(seed, bool):
                sub["seed"] = derived_seed(seed, choice)
            bodies.append(sub)
    return bodies


def summed_usage(usages: Mapping[int, Mapping[str, Any]], n: int) -> dict[str, Any]:
    """The request's usage from its legs' (keyed by choice index k; prompt = k // n)."""
    prompt_tokens: dict[int, int] = {}
    details: list[object] = []
    completion = 0
    base: dict[str, Any] = {}
    for k in sorted(usages):
        usage = usages[k]
        if not base:
            base = dict(usage)
        prompt = k // n
        if prompt not in prompt_tokens:
            prompt_tokens[prompt] = _int(usage.get("prompt_tokens"))
            details.append(usage.get(PROMPT_TOKENS_DETAILS))
        completion += _int(usage.get("completion_tokens"))
    prompt_total = sum(prompt_tokens.values())
    merged = {key: value for key, value in base.items() if key not in _USAGE_FIELDS}
    merged.update(prompt_tokens=prompt_total, total_tokens=prompt_total + completion,
                  completion_tokens=completion)
    if PROMPT_TOKENS_DETAILS in merged:
        merged[PROMPT_TOKENS_DETAILS] = summed_details(details)
    return merged


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def merge_answers(answers: Sequence[Mapping[str, Any]], n: int) -> dict[str, Any]:
    """One JSON answer from the legs' answers (leg k's choice becomes choice k)."""
    merged = dict(answers[0])
    choices: list[Any] = []
    usages: dict[int, Mapping[str, Any]] = {}
    for k, answer in enumerate(answers):
        for choice in answer.get("choices") or ():
            if isinstance(choice, Mapping):
                choices.append({**choice, "index": k})
        usage = answer.get("usage")
        if isinstance(usage, Mapping):
            usages[k] = usage
    merged["choices"] = choices
    if usages:
        merged["usage"] = summed_usage(usages, n)
    return merged


class SSEEvents:
    """Splits one leg's SSE bytes into its events' ``data`` payloads as they complete."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buffer += chunk
        if self._buffer.find(b"\n\n") < 0:  # not ``in``: bytes' ``in`` raises inside per call
            return []
        *events, self._buffer = self._buffer.replace(b"\r\n", b"\n").split(b"\n\n")
        payloads = []
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(DATA):
                    payloads.append(line[len(DATA):])
                elif line.startswith(DATA_FIELD):
                    payloads.append(line[len(DATA_FIELD):])
        return payloads

    @property
    def pending(self) -> bytes:
        """Bytes of an event not yet ended (a leg that closed here was cut)."""
        return self._buffer


class StreamMerger:
    """Rewrites the legs' stream chunks into one stream: index k, one id, usage summed.
    ``event(k, payload)``: the SSE event for leg k's payload, None when absorbed (``[DONE]``, a
    usage-only chunk), ``ValueError`` when not JSON; ``usage_event()``: the one usage chunk at
    the end, when any leg reported usage."""

    def __init__(self, n: int) -> None:
        self._n = n
        self._id: Any = None
        self._last: dict[str, Any] = {}
        self._usages: dict[int, Mapping[str, Any]] = {}
        self.done: set[int] = set()

    def event(self, k: int, payload: bytes) -> bytes | None:
        if payload.strip() == DONE_PAYLOAD:
            self.done.add(k)
            return None
        chunk = jsonutil.loads(payload)
        if not isinstance(chunk, dict):
            raise ValueError("stream chunk is not a JSON object")
        usage = chunk.get("usage")
        if isinstance(usage, Mapping):
            self._usages[k] = usage
            chunk["usage"] = None
        choices = chunk.get("choices")
        if not choices:
            if isinstance(usage, Mapping):
                self._remember(chunk)
                return None  # the leg's usage chunk: summed into one at the end
        else:
            chunk["choices"] = [
                {**choice, "index": k} if isinstance(choice, Mapping) else choice
                for choice in choices
            ]
        if self._id is None:
            self._id = chunk.get("id")
        elif "id" in chunk:
            chunk["id"] = self._id
        self._remember(chunk)
        return sse_event(jsonutil.dumps(chunk))

    def _remember(self, chunk: Mapping[str, Any]) -> None:
        if not self._last:
            self._last = {key: chunk[key] for key in ("object", "created", "model")
                          if key in chunk}

    def usage_event(self, tell: TellUsage | None = None) -> bytes | None:
        """The one usage chunk (``tell``: each leg's usage as the usage rule tells it)."""
        if not self._usages:
            return None
        usages = self._usages if tell is None else {
            k: tell(k, usage) for k, usage in self._usages.items()}
        chunk: dict[str, Any] = {"id": self._id, **self._last, "choices": [],
                                 "usage": summed_usage(usages, self._n)}
        return sse_event(jsonutil.dumps(chunk))
