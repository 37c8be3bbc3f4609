"""Proves the relay recognises an engine's in-stream error event wherever the reads cut it,
and nothing else: the event shapes vLLM and SGLang write (``data: {"error": ...}``), split at
every byte across two reads, and streams whose text merely talks about errors.

The end-to-end counting (metrics, log) is proven with the stub engines in
``tests/faults/test_stream_error_events.py``.
"""

from __future__ import annotations

import json

import pytest

from sidecar.http_server.relay import carries_error_event
from sidecar.protocol.sse import ERROR_EVENT

VLLM_EVENT = ("data: " + json.dumps({"error": {"message": "KV load failed", "type":
              "InternalServerError", "code": 500}}) + "\n\n").encode()
TOKEN = ("data: " + json.dumps({"choices": [{"index": 0, "text": 'a "error" {"error": 1}'}]})
         + "\n\n").encode()


def _relay(chunks: list[bytes]) -> bool:
    tail = b""
    for chunk in chunks:
        if carries_error_event(tail, chunk, ERROR_EVENT):
            return True
        tail = (tail + chunk)[-32:]
    return False


def test_a_whole_error_event_is_seen() -> None:
    assert _relay([TOKEN, VLLM_EVENT, b"data: [DONE]\n\n"])
    assert _relay([TOKEN + VLLM_EVENT + b"data: [DONE]\n\n"])


@pytest.mark.parametrize("cut", range(1, len(b'data: {"error"') + 2))
def test_an_event_cut_anywhere_by_the_reads_is_seen(cut: int) -> None:
    stream = TOKEN + VLLM_EVENT + b"data: [DONE]\n\n"
    at = len(TOKEN) + cut
    assert _relay([stream[:at], stream[at:]])


def test_token_text_about_errors_is_not_an_error() -> None:
    stream = TOKEN * 3 + b"data: [DONE]\n\n"
    assert not _relay([stream])
    assert not any(_relay([stream[:at], stream[at:]]) for at in range(1, len(stream)))
