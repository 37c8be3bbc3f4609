"""The decode engine's streamed completion, read as token ids and a finish reason.

    engine SSE bytes ─TokenStreamParser.feed()─▶ [token ids] ... ─finish()─▶ "stop"|"length"|"abort"

The ids arrive in ``choices[0].token_ids`` once the dialect's ``token_id_fields`` asked for
them; finish reasons collapse to three (docs/driving/grpc-contract.md#finish-reasons). Deliberate
limits: one
choice per stream (the contract has one sequence); only ``data:`` lines are read; an
``error`` object mid-stream is a ``DecodeFailed`` whose text is not relayed (it may quote the
prompt).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from sidecar import jsonutil
from sidecar.errors import DecodeFailed, Stage
from sidecar.protocol.sse import DATA_FIELD, DONE_PAYLOAD, ERROR_KEY

FINISH_STOP: Final = "stop"
FINISH_LENGTH: Final = "length"
FINISH_ABORT: Final = "abort"

CHOICES: Final = "choices"
TOKEN_IDS: Final = "token_ids"
FINISH_REASON: Final = "finish_reason"

#: Largest value a TokenStream.token_id (int32) can carry.
INT32_MAX: Final = (1 << 31) - 1
#: One SSE event line is never this long for a token chunk; a longer one is garbage.
MAX_PENDING_BYTES: Final = 4 * 1024 * 1024


#: Engine finish reasons that mean the request did not end normally.
_ABORT_REASONS: Final = frozenset({"abort", "aborted", "cancelled", "canceled", "error"})


def normalize_finish_reason(reason: str) -> str:
    """The contract's finish reason (stop | length | abort) for an engine's finish reason."""
    lowered = reason.lower()
    if lowered == FINISH_LENGTH:
        return FINISH_LENGTH
    if lowered in _ABORT_REASONS:
        return FINISH_ABORT
    return FINISH_STOP


def _broken(message: str) -> DecodeFailed:
    return DecodeFailed(f"decode engine stream: {message}", stage=Stage.DECODE)


class TokenStreamParser:
    """Incremental parser of one streamed completion (feed bytes as they arrive)."""

    def __init__(self) -> None:
        self._pending = bytearray()
        self._finish_reason: str | None = None
        self.done = False

    @property
    def finish_reason(self) -> str | None:
        """The normalized finish reason, once the engine sent one."""
        return self._finish_reason

    def feed(self, chunk: bytes) -> list[int]:
        """The token ids completed by ``chunk`` (possibly none)."""
        if self.done:
            return []
        self._pending += chunk
        tokens: list[int] = []
        while not self.done:
            end = self._pending.find(b"\n")
            if end < 0:
                break
            line = bytes(self._pending[:end]).rstrip(b"\r")
            del self._pending[: end + 1]
            tokens.extend(self._line(line))
        if len(self._pending) > MAX_PENDING_BYTES:
            raise _broken("an event line exceeds the size cap")
        return tokens

    def flush(self) -> list[int]:
        """Token ids of a last line the engine sent without its newline (call at the end)."""
        if self.done or not self._pending.strip():
            return []
        line = bytes(self._pending).strip()
        self._pending.clear()
        # An event cut in the middle fails here: a proper prefix of JSON never parses.
        return self._line(line)

    def finish(self) -> str:
        """The finish reason once the stream ended; raises ``DecodeFailed`` if it broke."""
        if self._finish_reason is None:
            raise _broken("the stream ended without a finish reason")
        return self._finish_reason

    def _line(self, line: bytes) -> list[int]:
        if not line.startswith(DATA_FIELD):
            return []  # blank separators, comments, other SSE fields
        data = line[len(DATA_FIELD):].strip()
        if data == DONE_PAYLOAD:
            self.done = True
            return []
        try:
            event = jsonutil.loads(data)
        except jsonutil.JSONDecodeError:
            raise _broken("an event is not JSON") from None
        if not isinstance(event, Mapping):
            raise _broken("an event is not a JSON object")
        if ERROR_KEY in event:
            raise _broken("the engine reported an error mid-stream")
        return self._choice(event.get(CHOICES))

    def _choice(self, choices: object) -> list[int]:
        if choices is None or choices == []:
            return []  # usage-only chunks
        if not isinstance(choices, list) or not isinstance(choices[0], Mapping):
            raise _broken("'choices' is not a list of objects")
        if len(choices) > 1:
            raise _broken("more than one choice in a chunk (n > 1 is not supported)")
        choice = choices[0]
        tokens = _token_ids(choice.get(TOKEN_IDS))
        reason = choice.get(FINISH_REASON)
        if reason is not None:
            if not isinstance(reason, str):
                raise _broken("'finish_reason' is not a string")
            self._finish_reason = normalize_finish_reason(reason)
        return tokens


def _token_ids(value: object) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _broken("'token_ids' is not a list")
    for token in value:
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token <= INT32_MAX:
            raise _broken("a token id is not an int32")
    return value
