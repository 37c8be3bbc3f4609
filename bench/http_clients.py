"""The load generator's HTTP clients behind one small interface, so flows run on either.

    async with open_clients("lean", concurrency) as new_http:
        http = new_http()              # one per closed-loop worker
        answer = await http.post(origin, "/v1/completions", headers, body, stream=True)

``lean`` (the default): ``bench.lean_client`` (``sidecar.http1.EngineClient``), each worker
owning its pool (one connection per origin, like wrk), SSE events counted as they arrive.
``aiohttp``: the load generator the bench had before, one pooled ``ClientSession`` shared by
all workers, kept for comparison.

Deliberate limits: POST only (the flows need nothing else); a transport failure raises one
of ``TRANSPORT_ERRORS``, which the load phases count as errors.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Final, Protocol

import aiohttp

from bench.lean_client import Answer, Client, EventCounter, EventTally, Origin
from sidecar.http1 import UpstreamError

CLIENTS: Final = ("lean", "aiohttp")
#: ValueError: a body that is not the JSON a flow expects (orjson's JSONDecodeError).
TRANSPORT_ERRORS: Final = (aiohttp.ClientError, UpstreamError, OSError, TimeoutError, ValueError)


class Http(Protocol):
    async def post(
        self, origin: Origin, path: str, headers: Mapping[str, str], body: bytes, stream: bool
    ) -> Answer: ...


class LeanHttp:
    """One worker's lean client; ``time_events``: streamed answers carry their token gaps."""

    def __init__(self, client: Client, time_events: bool = False) -> None:
        self.client = client
        self.time_events = time_events

    async def post(
        self, origin: Origin, path: str, headers: Mapping[str, str], body: bytes, stream: bool
    ) -> Answer:
        return await self.client.request(
            origin, "POST", path, headers, body, count_events=stream,
            time_events=self.time_events,
        )


class AiohttpHttp:
    """The shared aiohttp session, read as the bench always read it."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    async def post(
        self, origin: Origin, path: str, headers: Mapping[str, str], body: bytes, stream: bool
    ) -> Answer:
        url = f"http://{origin.host}:{origin.port}{path}"
        started = time.perf_counter()
        async with self.session.post(url, data=body, headers=headers) as response:
            if not stream:
                data = await response.read()
                done = time.perf_counter() - started
                return Answer(response.status, data, done, done, 0)
            first = 0.0
            counter = EventCounter()
            async for chunk in response.content.iter_any():
                if not first:
                    first = time.perf_counter() - started
                counter.feed(chunk)
        done = time.perf_counter() - started
        return Answer(response.status, b"", first or done, done, counter.events)


def make_session(concurrency: int) -> aiohttp.ClientSession:
    """The aiohttp load generator's pooled client: keep-alive connections, one per worker."""
    connector = aiohttp.TCPConnector(limit=max(concurrency, 1) * 2, limit_per_host=0,
                                     keepalive_timeout=4.0)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=60),
        trust_env=False,
        auto_decompress=False,
        skip_auto_headers=("User-Agent",),
    )


@contextlib.asynccontextmanager
async def open_clients(
    kind: str, concurrency: int, *, time_events: bool = False, tally: EventTally | None = None
) -> AsyncIterator[Callable[[], Http]]:
    """A factory of per-worker clients of ``kind``; everything it made is closed on exit.

    ``time_events`` (lean only): streamed answers carry their tokens' inter-arrival gaps;
    ``tally`` (lean only) counts every SSE event as it arrives."""
    if kind == "aiohttp":
        if time_events or tally is not None:
            raise ValueError("token timing needs the lean client")
        async with make_session(concurrency) as session:
            shared = AiohttpHttp(session)
            yield lambda: shared
        return
    if kind != "lean":
        raise ValueError(f"unknown client {kind!r}; known: {', '.join(CLIENTS)}")
    made: list[Client] = []

    def new() -> Http:
        client = Client(tally=tally)
        made.append(client)
        return LeanHttp(client, time_events)

    try:
        yield new
    finally:
        for client in made:
            await client.close()
