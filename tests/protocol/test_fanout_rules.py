"""Proves the pure fan-out rules (``sidecar.protocol.fanout``): sub-request bodies (prompt,
``n`` 1, derived seeds), the refusals, the merged JSON answer (index ``i * n + j``, one id,
usage summed with prompt tokens once per prompt), and the stream rewriting (events split across
reads, index and id rewritten, usage chunks absorbed into one, ``[DONE]`` absorbed).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from protocol_builders import parse_client_body

from sidecar.errors import InvalidRequest
from sidecar.protocol.context import Route
from sidecar.protocol.fanout import (
    SSEEvents,
    StreamMerger,
    check_fanout,
    derived_seed,
    merge_answers,
    sub_bodies,
)


def _client(**body: Any) -> Any:
    return parse_client_body(json.dumps({"model": "m", "prompt": "p", **body}).encode(),
                             Route.COMPLETIONS)


def test_sub_bodies_in_choice_index_order() -> None:
    client = _client(prompt=["a", "b"], n=2, seed=10, max_tokens=3)
    bodies = sub_bodies(client)
    assert [(b["prompt"], b["n"], b["seed"]) for b in bodies] == [
        ("a", 1, 10), ("a", 1, 11), ("b", 1, 10), ("b", 1, 11)]
    assert all(b["max_tokens"] == 3 and b["model"] == "m" for b in bodies)
    assert "n" not in sub_bodies(_client(prompt=[[1], [2]]))[0]
    assert client.body["prompt"] == ["a", "b"]  # the client's body is not changed


def test_derived_seeds_wrap() -> None:
    assert derived_seed(5, 0) == 5 and derived_seed(5, 2) == 7
    assert derived_seed((1 << 63) - 1, 1) == 0
    assert derived_seed(-3, 0) == -3  # choice 0 keeps whatever the client sent


def test_refusals() -> None:
    with pytest.raises(InvalidRequest, match="limit is 4"):
        check_fanout(_client(n=5), 4)
    check_fanout(_client(n=2, best_of=1), 4)
    for extra in ({"best_of": 2}, {"prompt_logprobs": 0},
                  {"stream_options": {"continuous_usage_stats": True}}):
        with pytest.raises(InvalidRequest, match="not supported with n > 1"):
            check_fanout(_client(n=2, **extra), 4)


def _answer(k: int, prompt_tokens: int) -> dict[str, Any]:
    return {"id": f"cmpl-{k}", "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": f"t{k}", "finish_reason": "length"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 2,
                      "total_tokens": prompt_tokens + 2}}


def test_merged_answer() -> None:
    # Two prompts (5 and 7 tokens) x n 2.
    merged = merge_answers([_answer(0, 5), _answer(1, 5), _answer(2, 7), _answer(3, 7)], 2)
    assert merged["id"] == "cmpl-0"
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [
        (0, "t0"), (1, "t1"), (2, "t2"), (3, "t3")]
    assert merged["usage"] == {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20}


def test_events_split_across_reads() -> None:
    events = SSEEvents()
    assert events.feed(b'data: {"a"') == []
    assert events.feed(b': 1}\n\ndata: [DO') == [b'{"a": 1}']
    assert events.feed(b"NE]\n\n") == [b"[DONE]"]
    assert events.pending == b""


def test_stream_rewriting() -> None:
    merger = StreamMerger(n=1)
    first = merger.event(1, b'{"id": "x1", "model": "m", "choices": [{"index": 0, "text": "a"}]}')
    second = merger.event(0, b'{"id": "x0", "model": "m", "choices": [{"index": 0, "text": "b"}]}')
    assert first is not None and second is not None
    assert json.loads(first[6:])["choices"][0]["index"] == 1
    chunk = json.loads(second[6:])
    assert (chunk["id"], chunk["choices"][0]["index"]) == ("x1", 0)
    usage = b'{"id": "x0", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}'
    assert merger.event(0, usage) is None
    assert merger.event(1, usage.replace(b"3", b"4")) is None
    assert merger.event(0, b"[DONE]") is None and merger.done == {0}
    final = merger.usage_event()
    assert final is not None
    assert json.loads(final[6:]) == {"id": "x1", "model": "m", "choices": [], "usage": {
        "prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}}
    with pytest.raises(ValueError):
        merger.event(0, b"not json")
    assert StreamMerger(n=2).usage_event() is None
