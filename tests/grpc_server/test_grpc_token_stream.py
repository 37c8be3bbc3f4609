"""Proves ``TokenStreamParser`` reads each engine's streamed completion as token ids plus the
contract's finish reason (docs/driving/grpc-contract.md#finish-reasons): the chunk shapes of vLLM,
SGLang and
TensorRT-LLM (token ids per chunk,
usage-only chunks, ``[DONE]``), events split at any byte, and every way a stream can break
(cut event, no finish reason, mid-stream error object, ids outside int32) as DecodeFailed.

Does not prove the engines send these shapes (the stubs and tests/real_vllm cover that).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from sidecar.dialects import dialect_class
from sidecar.errors import DecodeFailed
from sidecar.grpc_server.decode import TokenStreamParser, normalize_finish_reason


def token_id_fields(engine: str) -> dict[str, Any]:
    """The engine handler's declared token-id request fields."""
    return dict(dialect_class(engine, None).token_id_fields)


def _event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chunk(tokens: list[int] | None, finish: str | None = None, **extra: Any) -> bytes:
    choice: dict[str, Any] = {"index": 0, "text": "x", "finish_reason": finish, **extra}
    if tokens is not None:
        choice["token_ids"] = tokens
    return _event({"id": "cmpl-1", "object": "text_completion", "choices": [choice]})


VLLM_STREAM = (
    _chunk([1001], prompt_token_ids=[5, 6]) + _chunk([1002]) + _chunk([1003], "length")
    + _event({"id": "cmpl-1", "choices": [], "usage": {"completion_tokens": 3}})
    + b"data: [DONE]\n\n"
)
# SGLang may batch several tokens in one chunk (stream interval > 1).
SGLANG_STREAM = _chunk([1001, 1002]) + _chunk([1003], "stop", matched_stop=2) + b"data: [DONE]\n\n"
# TensorRT-LLM with detokenize=false: empty text, token_ids as the chunk's delta.
TRTLLM_STREAM = (
    _chunk([1001], stop_reason=None) + _chunk([], None) + _chunk([1002, 1003], "length")
    + b"data: [DONE]\n\n"
)


def _parse(stream: bytes, split: int | None = None) -> tuple[list[int], str]:
    parser = TokenStreamParser()
    tokens: list[int] = []
    pieces = [stream] if split is None else [stream[i : i + split]
                                              for i in range(0, len(stream), split)]
    for piece in pieces:
        tokens += parser.feed(piece)
    tokens += parser.flush()
    return tokens, parser.finish()


@pytest.mark.parametrize(
    ("stream", "finish"),
    [(VLLM_STREAM, "length"), (SGLANG_STREAM, "stop"), (TRTLLM_STREAM, "length")],
    ids=["vllm", "sglang", "trtllm"],
)
@pytest.mark.parametrize("split", [None, 1, 7], ids=["whole", "bytewise", "7-bytes"])
def test_engine_streams_give_their_token_ids(stream: bytes, finish: str, split: int | None) -> None:
    assert _parse(stream, split) == ([1001, 1002, 1003], finish)


def test_parser_stops_at_done_and_ignores_what_follows() -> None:
    parser = TokenStreamParser()
    assert parser.feed(_chunk([7], "length") + b"data: [DONE]\n\n" + _chunk([8])) == [7]
    assert parser.done
    assert parser.feed(_chunk([9])) == []


def test_crlf_lines_and_comments_are_read() -> None:
    stream = b": keep-alive\r\n\r\ndata: " + json.dumps(
        {"choices": [{"token_ids": [4], "finish_reason": "length"}]}
    ).encode() + b"\r\n\r\ndata: [DONE]\r\n\r\n"
    assert _parse(stream) == ([4], "length")


def test_last_line_without_newline_is_taken() -> None:
    parser = TokenStreamParser()
    raw = _chunk([3], "stop").rstrip(b"\n")
    assert parser.feed(raw) == []
    assert parser.flush() == [3]
    assert parser.finish() == "stop"


@pytest.mark.parametrize(
    "stream",
    [
        _chunk([1]) + _chunk([2])[:20],  # cut inside an event
        _chunk([1]) + b"data: [DONE]\n\n",  # no finish reason
        _chunk([1]) + _event({"error": {"message": "prompt quoted here", "code": 500}}),
        _event({"object": "error", "message": "x", "error": "boom"}),
        b"data: {not json}\n\n",
        _event(["not", "an", "object"]),
        _chunk([2**31]),
        _chunk([-1]),
        _chunk(["7"]),  # type: ignore[list-item]
        _event({"choices": [{"token_ids": [1]}, {"token_ids": [2]}]}),
        _event({"choices": "nope"}),
        _event({"choices": [{"token_ids": 5}]}),
        _event({"choices": [{"token_ids": [1], "finish_reason": 3}]}),
    ],
    ids=["cut", "no-finish", "error-object", "sglang-error", "not-json", "not-object",
         "too-big", "negative", "string-id", "n-2", "bad-choices", "ids-not-list", "bad-finish"],
)
def test_broken_streams_are_decode_failures(stream: bytes) -> None:
    with pytest.raises(DecodeFailed) as caught:
        _parse(stream)
    assert "prompt quoted here" not in caught.value.message


def test_an_endless_line_is_refused() -> None:
    parser = TokenStreamParser()
    with pytest.raises(DecodeFailed):
        parser.feed(b"data: " + b"x" * (5 * 1024 * 1024))


@pytest.mark.parametrize(
    ("engine_reason", "seed_reason"),
    [("length", "length"), ("stop", "stop"), ("eos", "stop"), ("content_filter", "stop"),
     ("tool_calls", "stop"), ("abort", "abort"), ("cancelled", "abort"), ("LENGTH", "length")],
)
def test_finish_reasons_collapse_to_the_seeds_three(engine_reason: str, seed_reason: str) -> None:
    assert normalize_finish_reason(engine_reason) == seed_reason


def test_each_engine_gets_its_own_documented_token_id_key() -> None:
    assert token_id_fields("vllm") == {"return_token_ids": True}
    assert token_id_fields("sglang") == {"return_token_ids": True}
    assert token_id_fields("trtllm") == {"detokenize": False}
