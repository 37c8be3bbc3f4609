"""Proves when a broken stream does not move, and says why, on stub engines:

- ``--migration-limit 0``: the error event as before migration existed, nothing counted;
- a second failure past the limit ends the stream with ``not migrated: limit`` after the
  tokens the continuation gave; with a higher limit it moves again (back to the local
  engine, which answers its health check);
- each refusal reason: ``guided_decoding``, ``logprobs``, ``penalties``, ``tools``,
  ``engine_state``, ``fanned_out``, ``stream_too_long``, ``finished``, ``stop_strings``,
  ``join``, ``no_target`` (``no_token_ids``: test_migration_shapes.py), each counted with its
  reason, named in the error event, nothing sent to another engine;
- an engine's own error event (a 5xx) moves the stream before the client sees it; a 4xx
  error event (the request's fault) reaches the client as the engine wrote it.

The stalls that a test releases (``release_hangs``) end a decode's stream without its end
event at the moment the test chooses: every ordering here is the test's, never a timer's.
``parsed_output`` (a chat delta holding reasoning or tool calls) is proven on recorded chunks
(tests/protocol/test_continuation.py): the stubs write text only.
"""

from __future__ import annotations

from typing import Any

import pytest
from migration_builders import (
    PROMPT,
    drop,
    generations,
    metric_reaches,
    moving_pair,
    next_event,
    open_stream,
    prompt_ids,
    read,
    route_body,
    text,
    tokens,
)

from sidecar.protocol.context import Route
from sidecar.tools.stubs.faults import Fault, FaultKind
from sidecar.tools.stubs.textgen import PrefillKind

MAX_TOKENS = 8
CUT = 3
COMPLETIONS = Route.COMPLETIONS.value


def stall(after: int) -> Fault:
    """The stream stops after ``after`` events until the test releases it (then it ends
    without its end event)."""
    return Fault(kind=FaultKind.STALL, after_chunks=after, times=1, path=COMPLETIONS)


async def test_with_migration_off_a_break_is_the_error_event_it_was() -> None:
    async with moving_pair(decode_faults=[drop(CUT)], limit=0) as pair:
        reply = await read(pair, Route.COMPLETIONS, route_body(Route.COMPLETIONS))
        assert reply.broken and reply.done == 0
        assert reply.error is not None and reply.error["code"] == "decode_failed"
        assert "not migrated" not in reply.error["message"]
        assert generations(pair.prefill) == 1
        assert await pair.sidecar.metric("disagg_migrations_total") == 0
        await metric_reaches(pair.sidecar, "disagg_requests_total", 1,
                             outcome="broken_stream")


@pytest.mark.parametrize("limit", [1, 2])
async def test_a_second_failure_moves_again_only_within_the_limit(limit: int) -> None:
    async with moving_pair(decode_faults=[stall(CUT)], limit=limit) as pair:
        body = route_body(Route.COMPLETIONS, max_tokens=MAX_TOKENS)
        async with open_stream(pair, Route.COMPLETIONS, body) as response:
            got = [await next_event(response) for _ in range(CUT)]
            # The continuation on the prefill target dies after two tokens in turn.
            pair.prefill.faults.set(drop(2))
            pair.decode.faults.release_hangs()
            rest = []
            try:
                while (event := await next_event(response)) != "[DONE]":
                    rest.append(event)
            except Exception:  # the connection closed after the error event
                pass
        prompt = prompt_ids()
        first = tokens(prompt, MAX_TOKENS, PrefillKind.REMOTE)[:CUT]
        second = tokens(prompt + first, MAX_TOKENS - CUT, PrefillKind.LOCAL)[:2]
        events = got + rest
        texts = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
        if limit == 1:
            assert texts == text(first + second)
            assert "not migrated: limit" in events[-1]["error"]["message"]
            await metric_reaches(pair.sidecar, "disagg_migrations_total", 1,
                                 outcome="refused", reason="limit")
        else:
            third = tokens(prompt + first + second, MAX_TOKENS - CUT - 2, PrefillKind.LOCAL)
            assert texts == text(first + second + third)
            await metric_reaches(pair.sidecar, "disagg_migrations_total", 2,
                                 outcome="migrated")
            whole = [r for r in pair.decode.recorder.on_path(COMPLETIONS)
                     if isinstance(r.json.get("prompt"), list)]
            assert [r.json["prompt"] for r in whole] == [prompt + first + second]


REFUSED: list[tuple[str, Route, dict[str, Any]]] = [
    ("guided_decoding", Route.CHAT,
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
    ("logprobs", Route.COMPLETIONS, {"logprobs": 1}),
    ("penalties", Route.COMPLETIONS, {"presence_penalty": 0.5}),
    ("tools", Route.CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("engine_state", Route.CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": PROMPT},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]}),
]


@pytest.mark.parametrize(("reason", "route", "extra"), REFUSED, ids=[r[0] for r in REFUSED])
async def test_a_body_that_cannot_continue_exactly_is_refused_naming_why(
        reason: str, route: Route, extra: dict[str, Any]) -> None:
    cut = CUT + (1 if route is Route.CHAT else 0)  # a chat stream's role chunk first
    async with moving_pair(decode_faults=[drop(cut)]) as pair:
        reply = await read(pair, route, route_body(route, max_tokens=MAX_TOKENS, **extra))
        assert_refused(generations(pair.prefill), reply, reason)
        # Nothing was asked of the engine the stream could not use.
        decode_body = (await pair.decode.recorder.next_request(route.value)).json
        assert "return_token_ids" not in decode_body
        await metric_reaches(pair.sidecar, "disagg_migrations_total", 1, outcome="refused",
                             reason=reason)


def assert_refused(prefill_calls: int, reply: Any, reason: str) -> None:
    assert reply.status == 200 and reply.done == 0
    assert reply.error is not None and reply.error["code"] == "decode_failed"
    assert reply.error["message"].endswith(f"not migrated: {reason}")
    assert prefill_calls == 1  # its prefill leg only


async def test_fanned_out_streams_are_refused_naming_why() -> None:
    async with moving_pair(decode_faults=[drop(CUT)]) as pair:
        reply = await read(pair, Route.COMPLETIONS,
                           route_body(Route.COMPLETIONS, max_tokens=MAX_TOKENS, n=2))
        assert reply.done == 0 and reply.error is not None
        assert reply.error["message"].endswith("not migrated: fanned_out")
        await metric_reaches(pair.sidecar, "disagg_migrations_total", 1, outcome="refused",
                             reason="fanned_out")


async def test_a_stream_past_the_kept_size_is_refused() -> None:
    # Each stub chunk is about 230 bytes: 300 of them pass the 64 KiB floor of the cap.
    async with moving_pair(decode_faults=[drop(290)], migration_max_stream_bytes=64 * 1024,
                           decode={"max_model_len": 4096},
                           prefill={"max_model_len": 4096}) as pair:
        reply = await read(pair, Route.COMPLETIONS, route_body(Route.COMPLETIONS,
                                                               max_tokens=300))
        assert_refused(generations(pair.prefill), reply, "stream_too_long")


async def test_an_answer_whose_end_alone_was_lost_is_refused_as_finished() -> None:
    async with moving_pair(decode_faults=[drop(MAX_TOKENS)]) as pair:
        reply = await read(pair, Route.COMPLETIONS, route_body(Route.COMPLETIONS,
                                                               max_tokens=MAX_TOKENS))
        assert reply.text == text(tokens(prompt_ids(), MAX_TOKENS, PrefillKind.REMOTE))
        assert_refused(generations(pair.prefill), reply, "finished")


async def test_a_stop_string_that_could_span_the_join_is_refused() -> None:
    first = tokens(prompt_ids(), MAX_TOKENS, PrefillKind.REMOTE)[:CUT]
    stop = text(first)[-2:] + "\u2603"  # begins with the text's last two characters
    async with moving_pair(decode_faults=[drop(CUT)]) as pair:
        reply = await read(pair, Route.COMPLETIONS,
                           route_body(Route.COMPLETIONS, max_tokens=MAX_TOKENS, stop=[stop]))
        # The ids' text was read from the target (the join), then nothing else was sent.
        assert reply.error is not None
        assert reply.error["message"].endswith("not migrated: stop_strings")
        assert len(pair.prefill.recorder.on_path(COMPLETIONS)) == 1


async def test_a_stop_string_that_cannot_span_the_join_moves() -> None:
    async with moving_pair(decode_faults=[drop(CUT)]) as pair:
        reply = await read(pair, Route.COMPLETIONS,
                           route_body(Route.COMPLETIONS, max_tokens=MAX_TOKENS,
                                      stop=["\u2603\u2603"]))
        assert reply.done == 1 and reply.error is None


async def test_text_that_cannot_be_matched_to_its_ids_is_refused_as_join() -> None:
    # The target cannot read the ids back as text: the join point is unknown.
    read_back = Fault(kind=FaultKind.STATUS, status=500, path="/detokenize")
    async with moving_pair(decode_faults=[drop(CUT)], prefill_faults=[read_back]) as pair:
        reply = await read(pair, Route.COMPLETIONS, route_body(Route.COMPLETIONS))
        assert_refused(len(pair.prefill.recorder.on_path(COMPLETIONS)), reply, "join")


async def test_nowhere_to_go_is_refused_as_no_target() -> None:
    # SGLang's prefill servers cannot run a request whole, no --migration-url is set, and the
    # local engine no longer answers its health check.
    async with moving_pair("sglang", decode_faults=[stall(CUT)]) as pair:
        body = route_body(Route.COMPLETIONS, max_tokens=MAX_TOKENS)
        async with open_stream(pair, Route.COMPLETIONS, body) as response:
            for _ in range(CUT):
                await next_event(response)
            pair.decode.faults.set(Fault(kind=FaultKind.STATUS, status=503, path="/health"))
            pair.decode.faults.release_hangs()
            error = await next_event(response)
        assert error["error"]["message"].endswith("not migrated: no_target")
        await metric_reaches(pair.sidecar, "disagg_migrations_total", 1, outcome="refused",
                             reason="no_target")


async def test_an_engines_own_error_event_moves_the_stream_unseen() -> None:
    fault = Fault(kind=FaultKind.ERROR_EVENT, after_chunks=CUT, times=1)
    async with moving_pair(decode_faults=[fault]) as pair:
        reply = await read(pair, Route.COMPLETIONS, route_body(Route.COMPLETIONS,
                                                               max_tokens=MAX_TOKENS))
        first = tokens(prompt_ids(), MAX_TOKENS, PrefillKind.REMOTE)[:CUT]
        rest = tokens(prompt_ids() + first, MAX_TOKENS - CUT, PrefillKind.LOCAL)
        assert reply.done == 1 and reply.error is None
        assert reply.text == text(first + rest)
        await metric_reaches(pair.sidecar, "disagg_migrations_total", 1, outcome="migrated",
                             reason="decode_failed")


async def test_a_4xx_error_event_reaches_the_client_as_written() -> None:
    # A stream the engine refused for the request's own fault would fail anywhere: not moved.
    fault = Fault(kind=FaultKind.ERROR_EVENT, after_chunks=CUT, times=1, status=400,
                  message="stub fault: bad request")
    async with moving_pair(decode_faults=[fault]) as pair:
        reply = await read(pair, Route.COMPLETIONS, route_body(Route.COMPLETIONS,
                                                               max_tokens=MAX_TOKENS))
        assert reply.done == 1  # relayed as the engine wrote it: its error, then [DONE]
        assert reply.error == {"message": "stub fault: bad request",
                               "type": "BadRequestError", "code": 400}
        assert generations(pair.prefill) == 1
        assert await pair.sidecar.metric("disagg_migrations_total") == 0
        # Counted as the decode error it is, as a stream relayed without migration is.
        await metric_reaches(pair.sidecar, "disagg_requests_total", 1, outcome="error")
        # Counted as the decode error it is, as a stream relayed without migration is.
        await metric_reaches(pair.sidecar, "disagg_requests_total", 1, outcome="error")
