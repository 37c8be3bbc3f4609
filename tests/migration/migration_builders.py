"""Builders of the migration suites: a stub pair behind a sidecar with migration on, the
stream a client reads, and what the stub engines answer (their generator is a pure function
of the prompt's ids: ``sidecar.tools.stubs.textgen``).

    async with moving_pair("vllm", decode_faults=[drop(3)]) as pair:
        reply = await read(pair, Route.COMPLETIONS, body)
        reply.events / reply.text / reply.done / reply.error
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from sidecar_builders import RunningSidecar, decode_sidecar_settings, running_sidecar, stub_pair

from sidecar.protocol.context import Route
from sidecar.tools.stubs import Stub, textgen
from sidecar.tools.stubs.faults import Fault, FaultKind
from sidecar.tools.stubs.textgen import PrefillKind

PROMPT = "Disaggregated serving splits prefill and decode."


def drop(after: int, times: int | None = 1) -> Fault:
    """The stream's connection closed after ``after`` events (an engine that died)."""
    return Fault(kind=FaultKind.DROP, after_chunks=after, times=times)


@dataclass
class PDPair:
    prefill: Stub
    decode: Stub
    sidecar: RunningSidecar

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.prefill.port}"


@contextlib.asynccontextmanager
async def moving_pair(engine: str = "vllm", connector: str = "shfs", *,
                      decode_faults: list[Fault] | None = None,
                      prefill_faults: list[Fault] | None = None,
                      limit: int = 1, prefill: dict[str, Any] | None = None,
                      decode: dict[str, Any] | None = None,
                      **overrides: Any) -> AsyncIterator[PDPair]:
    """A stub pair behind a sidecar with ``--migration-limit limit``."""
    async with stub_pair(
        engine, connector,
        prefill={"faults": tuple(prefill_faults or ()), **(prefill or {})},
        decode={"faults": tuple(decode_faults or ()), **(decode or {})},
    ) as (prefill_stub, decode_stub):
        settings = decode_sidecar_settings(engine, connector, prefill_stub, decode_stub,
                                           migration_limit=limit, **overrides)
        async with running_sidecar(**settings) as sidecar:
            yield PDPair(prefill_stub, decode_stub, sidecar)


async def metric_reaches(sidecar: RunningSidecar, name: str, value: float, *,
                         timeout_s: float = 10.0, **labels: str) -> None:
    """Wait until a metric reads ``value`` (a request is counted after its last byte left;
    the state is only observable by scraping)."""
    async with asyncio.timeout(timeout_s):
        while await sidecar.metric(name, **labels) != value:  # noqa: ASYNC110
            await asyncio.sleep(0.01)


@dataclass
class Reply:
    status: int
    raw: bytes
    #: Each ``data:`` payload, parsed (``[DONE]`` as the string).
    events: list[Any] = field(default_factory=list)
    #: The connection broke before the body's end.
    broken: bool = False

    @property
    def done(self) -> int:
        """How many ``[DONE]`` events the stream carried."""
        return sum(1 for event in self.events if event == "[DONE]")

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [event for event in self.events if isinstance(event, dict)]

    @property
    def text(self) -> str:
        pieces = []
        for chunk in self.chunks:
            for choice in chunk.get("choices") or []:
                if "text" in choice:
                    pieces.append(choice["text"] or "")
                else:
                    pieces.append((choice.get("delta") or {}).get("content") or "")
        return "".join(pieces)

    @property
    def ids(self) -> list[int]:
        out: list[int] = []
        for chunk in self.chunks:
            for choice in chunk.get("choices") or []:
                out += choice.get("token_ids") or []
        return out

    @property
    def usage(self) -> dict[str, Any] | None:
        found = [chunk["usage"] for chunk in self.chunks if chunk.get("usage")]
        return found[-1] if found else None

    @property
    def error(self) -> dict[str, Any] | None:
        errors = [chunk["error"] for chunk in self.chunks if "error" in chunk]
        return errors[-1] if errors else None


async def read(pair: PDPair, route: Route, body: dict[str, Any], *,
               headers: dict[str, str] | None = None, with_target: bool = True) -> Reply:
    """POST ``body`` through the sidecar; the whole answer (a cut one too)."""
    sent = {"x-prefiller-host-port": pair.target} if with_target else {}
    sent.update(headers or {})
    async with aiohttp.ClientSession() as session:
        async with session.post(pair.sidecar.url + route.value, json=body,
                                headers=sent) as response:
            broken = False
            pieces: list[bytes] = []
            try:
                async for piece in response.content.iter_any():
                    pieces.append(piece)
            except aiohttp.ClientPayloadError:
                broken = True  # the sidecar ended it with an error event and closed
            raw = b"".join(pieces)
            reply = Reply(response.status, raw, broken=broken)
    if body.get("stream"):
        for line in raw.decode().split("\n"):
            if line.startswith("data: "):
                payload = line[6:]
                reply.events.append(payload if payload == "[DONE]" else json.loads(payload))
    return reply


def generations(stub: Stub) -> int:
    """The requests an engine was asked to compute (POSTs): not the sidecar's GETs (its check
    of what a prefill target serves, its probes)."""
    return sum(request.method == "POST" for request in stub.recorder.requests)


def tokens(prompt_ids: list[int], count: int, kind: PrefillKind) -> list[int]:
    """The ids a stub generates for ``prompt_ids``: REMOTE on a decode with a good hand-off,
    LOCAL where the engine computed the prompt itself (a whole run)."""
    ids, _ = textgen.generate(textgen.prompt_digest(prompt_ids), count, kind)
    return ids


def text(ids: list[int]) -> str:
    return textgen.decode_tokens(ids)


def prompt_ids(prompt: str = PROMPT) -> list[int]:
    return textgen.encode_text(prompt)


def chat_prompt_ids(prompt: str = PROMPT) -> list[int]:
    return textgen.encode_text(textgen.chat_template([{"role": "user", "content": prompt}]))


@contextlib.asynccontextmanager
async def open_stream(pair: PDPair, route: Route, body: dict[str, Any], *,
                      with_target: bool = True) -> AsyncIterator[aiohttp.ClientResponse]:
    """A stream through the sidecar, open for reading event by event (``next_event``)."""
    sent = {"x-prefiller-host-port": pair.target} if with_target else {}
    async with aiohttp.ClientSession() as session:
        async with session.post(pair.sidecar.url + route.value, json=body,
                                headers=sent) as response:
            yield response


async def next_event(response: aiohttp.ClientResponse) -> Any:
    """The next ``data:`` payload of an open stream (parsed; ``[DONE]`` as the string)."""
    while True:
        line = (await response.content.readuntil(b"\n")).decode().strip()
        if line.startswith("data: "):
            payload = line[len("data: "):]
            return payload if payload == "[DONE]" else json.loads(payload)


def route_body(route: Route, *, stream: bool = True, max_tokens: int = 8,
               **extra: Any) -> dict[str, Any]:
    """A greedy body of ``route`` for the stubs (token-in: ``GENERATE_IDS``)."""
    body: dict[str, Any] = {"model": "stub-model"}
    if route is Route.COMPLETIONS:
        body.update(prompt=PROMPT, max_tokens=max_tokens)
    elif route is Route.CHAT:
        body.update(messages=[{"role": "user", "content": PROMPT}], max_tokens=max_tokens)
    elif route is Route.RESPONSES:
        body.update(input=PROMPT, max_output_tokens=max_tokens)
    elif route is Route.MESSAGES:
        body.update(messages=[{"role": "user", "content": PROMPT}], max_tokens=max_tokens)
    else:
        body.update(token_ids=GENERATE_IDS, sampling_params={"max_tokens": max_tokens})
    body["temperature"] = 0
    if stream:
        body["stream"] = True
    body.update(extra)
    return body


#: The token-in route's prompt.
GENERATE_IDS = [17, 29, 31, 43, 51, 67, 71, 83, 97, 101]
