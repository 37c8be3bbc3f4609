"""Proves where a continuation starts (``join_point``) on built streams and a byte-level
read-back like vLLM's ``/detokenize``: at the last chunk end whose last id finishes a
character, with the client's text after it to regenerate; a special token earlier in the
answer (a stream leaves its text out, a read-back keeps it) does not stop the join, which
read the whole answer back and failed there on real vLLM (a chat stream killed about 190
tokens in, past the ``<unk>`` the test model wrote at token 188, 2026-12-06); no finished
character among the last marks is ``join``; the marks a stream and a continuation leave.

Does not prove a live engine's read-back (tests/real_vllm/test_migration.py).
"""

from __future__ import annotations

import pytest

from sidecar.dialects.continuation import completions_places
from sidecar.protocol.context import Route
from sidecar.protocol.continuation import JOIN_MARKS, Join, SoFar, read_stream
from sidecar.request.migration import NotAligned, join_point

SPECIAL = 2
#: A byte-level vocabulary: what each id's bytes are when read back.
VOCAB: dict[int, bytes] = {SPECIAL: b"</s>", 10: b"a", 11: b"b", 12: b"\xc3", 13: b"\xa9"}
PROMPT = [10, 11, 10]


async def read_back(ids: list[int]) -> str:
    """Like vLLM's ``/detokenize``: every id's bytes (special tokens too) as UTF-8, an
    unfinished character written U+FFFD."""
    return b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace")


def streamed(*chunks: tuple[list[int], str]) -> SoFar:
    """A stream's read-back, one chunk per (ids, text) as the engine wrote them."""
    so_far = SoFar(Route.COMPLETIONS, prompt_ids=list(PROMPT))
    for ids, text in chunks:
        so_far.ids += ids
        so_far.text += text
        so_far.mark()
    return so_far


async def test_the_join_is_at_the_last_chunk_end_when_its_character_is_whole() -> None:
    so_far = streamed(([10], "a"), ([11, 10], "ba"))
    assert await join_point(so_far, read_back) == (3, "")


async def test_a_special_token_earlier_in_the_answer_does_not_stop_the_join() -> None:
    # The stream leaves "</s>" out; read back whole, the answer would never match the text.
    so_far = streamed(([10], "a"), ([SPECIAL], ""), *[([11], "b")] * 40)
    assert await join_point(so_far, read_back) == (42, "")


async def test_a_character_held_back_moves_the_join_to_the_chunk_before() -> None:
    # The last id is the first byte of "é": the engine wrote nothing for it yet.
    so_far = streamed(([10], "a"), ([11], "b"), ([12], ""))
    assert await join_point(so_far, read_back) == (2, "")


async def test_text_after_the_join_is_what_the_continuation_regenerates() -> None:
    # A chunk of "é" finished and a held-back byte after it, in one chunk: the join goes back
    # to the chunk before, and the client's "bé" is regenerated, not written again.
    so_far = streamed(([10], "a"), ([11, 12, 13, 12], "bé"))
    assert await join_point(so_far, read_back) == (1, "bé")


async def test_no_finished_character_among_the_marks_is_join() -> None:
    so_far = streamed(*[([12], "")] * (JOIN_MARKS + 1))
    with pytest.raises(NotAligned):
        await join_point(so_far, read_back)


async def test_a_short_answer_reads_the_prompts_last_ids_with_it() -> None:
    seen: list[list[int]] = []

    async def recording(ids: list[int]) -> str:
        seen.append(ids)
        return await read_back(ids)

    await join_point(streamed(([11], "b")), recording)
    assert seen == [[*PROMPT, 11]]


def test_a_stream_marks_each_chunk_end_that_carried_ids() -> None:
    events = (
        b'data: {"id":"c","object":"text_completion","created":1,"model":"tiny","choices":'
        b'[{"index":0,"text":"","finish_reason":null,"prompt_token_ids":[57,558],'
        b'"token_ids":[127]}]}\n\n'
        b'data: {"id":"c","object":"text_completion","created":1,"model":"tiny","choices":'
        b'[{"index":0,"text":"xy","finish_reason":null,"token_ids":[1673,5]}]}\n\n'
        b'data: {"id":"c","object":"text_completion","created":1,"model":"tiny","choices":'
        b'[{"index":0,"text":"","finish_reason":"length","token_ids":[]}]}\n\n'
    )
    so_far = read_stream(Route.COMPLETIONS, events, completions_places(unasked_null=True), {})
    assert list(so_far.marks) == [(1, 0), (3, 2)]


def test_only_the_last_marks_are_kept() -> None:
    so_far = streamed(*[([10], "a")] * (JOIN_MARKS + 5))
    assert [ids for ids, _ in so_far.marks] == list(range(6, JOIN_MARKS + 6))


def test_a_continuation_marks_its_chunks_past_what_it_regenerates() -> None:
    so_far = streamed(([10], "a"), ([11], "b"))
    join = Join(so_far, Route.COMPLETIONS, completions_places(unasked_null=True), asked=True,
                produced=1, skip_text="b", skip_ids=[11])
    for ids, text in (([11], "b"), ([10], "a")):
        join.chunk({"id": "c", "choices": [{"index": 0, "text": text, "token_ids": ids}]})
    assert list(so_far.marks)[-1] == (3, 3)
    assert so_far.text == "aba"
