"""Proves migration for the engines whose prefill servers cannot run a request whole, on
their stubs (their request models, not live engines: neither runs on this machine):

- SGLang: a completions stream continues on the ``--migration-url`` engine, its token ids
  asked with SGLang's ``return_token_ids`` and left out of the client's chunks as SGLang
  leaves them out unasked; the pair's legs get SGLang's abort call; a chat stream (SGLang
  streams no ids on chat) ends naming ``no_token_ids``;
- TensorRT-LLM: no stream carries ids with its text (``no_token_ids``); a JSON answer whose
  engine died runs again on the ``--migration-url`` engine.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

from migration_builders import (
    PDPair,
    chat_prompt_ids,
    drop,
    metric_reaches,
    prompt_ids,
    read,
    route_body,
    text,
    tokens,
)
from sidecar_builders import decode_sidecar_settings, running_sidecar, stub_pair

from sidecar.dialects.sglang import ABORT_PATH
from sidecar.protocol.context import Route
from sidecar.tools.stubs import Stub, StubConfig, run_stub
from sidecar.tools.stubs.faults import Fault, FaultKind
from sidecar.tools.stubs.textgen import PrefillKind

MAX_TOKENS = 8
CUT = 3


@contextlib.asynccontextmanager
async def with_pool(engine: str, decode_faults: list[Fault]) -> AsyncIterator[
        tuple[PDPair, Stub]]:
    """A stub pair behind a sidecar whose ``--migration-url`` is a third stub engine that
    runs requests whole."""
    async with (
        stub_pair(engine, "shfs", decode={"faults": tuple(decode_faults)}) as (prefill, decode),
        run_stub(StubConfig(engine=engine, role="both")) as spare,
    ):
        settings = decode_sidecar_settings(engine, "shfs", prefill, decode, migration_limit=1,
                                           migration_urls=(spare.url,))
        async with running_sidecar(**settings) as sidecar:
            yield PDPair(prefill, decode, sidecar), spare


async def test_an_sglang_stream_continues_on_the_migration_engine() -> None:
    async with with_pool("sglang", [drop(CUT)]) as (pair, spare):
        reply = await read(pair, Route.COMPLETIONS,
                           route_body(Route.COMPLETIONS, max_tokens=MAX_TOKENS))
        first = tokens(prompt_ids(), MAX_TOKENS, PrefillKind.REMOTE)[:CUT]
        rest = tokens(prompt_ids() + first, MAX_TOKENS - CUT, PrefillKind.LOCAL)

        assert reply.status == 200 and reply.done == 1
        assert reply.text == text(first + rest)
        assert all("token_ids" not in choice and "prompt_token_ids" not in choice
                   for chunk in reply.chunks for choice in chunk["choices"])
        continued = await spare.recorder.next_request(Route.COMPLETIONS.value)
        assert continued.json["prompt"] == prompt_ids() + first
        assert continued.json["return_token_ids"] is True
        # The pair's legs were told to stop, as for any request that ends unfinished.
        aborted = await pair.decode.recorder.next_request(ABORT_PATH)
        assert aborted.json["rid"].startswith(reply.chunks[0]["id"])
        await metric_reaches(pair.sidecar, "disagg_migrations_total", 1, outcome="migrated")


async def test_an_sglang_chat_stream_carries_no_ids_and_is_refused() -> None:
    async with with_pool("sglang", [drop(CUT + 1)]) as (pair, spare):
        reply = await read(pair, Route.CHAT, route_body(Route.CHAT, max_tokens=MAX_TOKENS))
        assert reply.done == 0 and reply.error is not None
        assert reply.error["message"].endswith("not migrated: no_token_ids")
        assert spare.recorder.total == 0
        assert len(chat_prompt_ids()) > 0


async def test_a_trtllm_stream_is_refused_its_json_runs_again_on_the_migration_engine(
        ) -> None:
    async with with_pool("trtllm", [drop(CUT), Fault(kind=FaultKind.DROP, times=1)]) as (
            pair, spare):
        reply = await read(pair, Route.COMPLETIONS,
                           route_body(Route.COMPLETIONS, max_tokens=MAX_TOKENS))
        assert reply.error is not None
        assert reply.error["message"].endswith("not migrated: no_token_ids")
        answer = await read(pair, Route.COMPLETIONS,
                            route_body(Route.COMPLETIONS, stream=False, max_tokens=MAX_TOKENS))
        assert answer.status == 200
        assert json.loads(answer.raw)["choices"][0]["text"] == text(
            tokens(prompt_ids(), MAX_TOKENS, PrefillKind.LOCAL))
        moved = await spare.recorder.next_request(Route.COMPLETIONS.value)
        assert moved.json == route_body(Route.COMPLETIONS, stream=False, max_tokens=MAX_TOKENS)
        await metric_reaches(pair.sidecar, "disagg_migrations_total", 1, outcome="migrated")
