"""Builders and checks shared by the fault-injection suite.

    async with rig("sglang", prefill_faults=[...], prefill_timeout_s=0.5) as r:
        reply = await r.post(stream=True)
        reply.expect_error(502, "prefill_failed")       # or reply.expect_broken_stream(code)
        await r.check_recovered()                        # the four after-conditions

``check_recovered`` is the contract every scenario ends with: both stub engines have nothing
in flight (every upstream call the sidecar made was closed), the sidecar's in-flight gauge is
back to zero, and, with the faults cleared, the same sidecar serves a streamed and a JSON
request. The rig owns its stubs and sidecar, on OS-chosen loopback ports; a stub can be
stopped and started again on the same port (an engine restart).

Deliberate limits: waits are bounded so a broken scenario fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import openai_builders
import pytest
from multidict import CIMultiDict
from sidecar_builders import RunningSidecar, decode_sidecar_settings, running_sidecar

from sidecar.protocol.context import PrefillTarget, Route
from sidecar.targets.breaker import CircuitBreakers
from sidecar.tools.stubs.config import StubConfig
from sidecar.tools.stubs.faults import Fault, FaultKind
from sidecar.tools.stubs.server import Stub

PROMPT = "Faults must never hang a request."
WAIT_S = 10.0

#: Every engine/connector pair; concurrent ones run both legs at the same time.
PAIRS: tuple[tuple[str, str], ...] = (
    ("vllm", "shfs"),
    ("vllm", "nixl"),
    ("vllm", "mooncake"),
    ("sglang", "shfs"),
    ("trtllm", "shfs"),
)
CONCURRENT: frozenset[tuple[str, str]] = frozenset({("vllm", "mooncake"), ("sglang", "shfs")})
SEQUENTIAL: tuple[tuple[str, str], ...] = tuple(p for p in PAIRS if p not in CONCURRENT)


def engine_param(engine: str, connector: str, *rest: Any) -> Any:
    """A pytest param for one pair (every pair's stub engine ships with the sidecar)."""
    return pytest.param(
        engine, connector, *rest,
        id="-".join([engine, connector, *(str(x) for x in rest if isinstance(x, str))]),
    )


def client_body(route: Route = Route.COMPLETIONS, *, stream: bool = False,
                max_tokens: int = 6, **extra: Any) -> dict[str, Any]:
    return openai_builders.client_body(route, stream=stream, max_tokens=max_tokens, prompt=PROMPT,
                                     **extra)


@dataclass
class Reply:
    """What a client got: status, headers, the body bytes it read, whether the body broke."""

    status: int
    headers: CIMultiDict[str]
    body: bytes
    broken: bool = False

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def events(self) -> list[str]:
        return [line[6:] for line in self.text.split("\n") if line.startswith("data: ")]

    def expect_ok(self, *, stream: bool) -> None:
        assert self.status == 200, (self.status, self.text[:300])
        assert not self.broken
        if stream:
            events = self.events()
            assert events and events[-1] == "[DONE]", self.text[-300:]
        else:
            assert json.loads(self.body)["choices"], self.text[:300]

    def expect_error(self, status: int, code: str, *, relayed: bool | None = None) -> None:
        """An OpenAI-shaped error with ``status`` and ``code``; of the engine's body only a
        4xx reason (``relayed``; default: for ``engine_rejected_request``), never a 5xx
        body."""
        assert self.status == status, (self.status, self.text[:300])
        payload = json.loads(self.body)
        assert set(payload) == {"error"}, payload
        assert payload["error"]["code"] == code, payload
        if relayed if relayed is not None else code == "engine_rejected_request":
            assert payload["error"]["message"].endswith(": stub fault"), payload
        else:
            assert "stub fault" not in self.text  # 5xx error bodies are never relayed

    def expect_broken_stream(self, code: str) -> None:
        """A stream that began (200) and ended with one error event and no ``[DONE]``."""
        assert self.status == 200, (self.status, self.text[:300])
        events = self.events()
        assert events, self.text
        assert "[DONE]" not in events, self.text[-300:]
        last = json.loads(events[-1])
        assert last.get("error", {}).get("code") == code, last


async def read_reply(response: aiohttp.ClientResponse) -> Reply:
    buffer = bytearray()
    broken = False
    try:
        async for chunk in response.content.iter_any():
            buffer += chunk
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
            aiohttp.ClientOSError):
        broken = True
    return Reply(response.status, CIMultiDict(response.headers), bytes(buffer), broken)


async def eventually(check: Callable[[], Awaitable[bool]], *, timeout_s: float = WAIT_S) -> None:
    """Poll ``check`` until it holds; fail after ``timeout_s`` (state, not timing, decides)."""
    async with asyncio.timeout(timeout_s):
        # The gauge is only observable by scraping /metrics: there is no event to wait on.
        while not await check():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


@dataclass
class Rig:
    """A prefill stub, a decode stub and the sidecar in front of them."""

    engine: str
    connector: str
    prefill: Stub
    decode: Stub
    sidecar: RunningSidecar
    _client: aiohttp.ClientSession = field(repr=False)
    _stack: contextlib.AsyncExitStack = field(repr=False)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.prefill.port}"

    @property
    def concurrent(self) -> bool:
        return (self.engine, self.connector) in CONCURRENT

    async def post(
        self,
        route: Route = Route.COMPLETIONS,
        *,
        stream: bool = False,
        body: dict[str, Any] | bytes | None = None,
        headers: dict[str, str] | None = None,
        with_target: bool = True,
    ) -> Reply:
        sent_headers = {"x-prefiller-host-port": self.target} if with_target else {}
        sent_headers.update(headers or {})
        payload = body if body is not None else client_body(route, stream=stream)
        kwargs: dict[str, Any] = (
            {"data": payload} if isinstance(payload, bytes) else {"json": payload}
        )
        async with self._client.post(
            self.sidecar.url + route.value, headers=sent_headers, **kwargs
        ) as response:
            return await read_reply(response)

    async def inflight(self) -> float:
        return await self.sidecar.metric("disagg_inflight_requests", front_door="http")

    async def inflating(self) -> float:
        """Inflated bytes of compressed bodies the sidecar is still reading."""
        return await self.sidecar.metric("disagg_inflating_body_bytes")

    async def wait_upstreams_closed(self) -> None:
        """Every call the sidecar made to either engine has ended (no leaked upstream call)."""
        await self.prefill.wait_idle(timeout_s=WAIT_S)
        await self.decode.wait_idle(timeout_s=WAIT_S)

    async def wait_gauge_zero(self) -> None:
        async def zero() -> bool:
            return await self.inflight() == 0

        await eventually(zero)

    async def stop_engine(self, role: str) -> None:
        """The engine process dies: its listening socket and connections close."""
        await (self.prefill if role == "prefill" else self.decode).stop()

    async def start_engine(self, role: str) -> Stub:
        """A fresh engine of the same kind comes back on the same ports (a restart)."""
        old = self.prefill if role == "prefill" else self.decode
        config = replace(old.config, port=old.port, bootstrap_port=old.bootstrap_port or 0)
        fresh = await self._stack.enter_async_context(started_stub(config))
        if role == "prefill":
            self.prefill = fresh
        else:
            self.decode = fresh
        return fresh

    async def check_recovered(self) -> None:
        """Upstreams closed, gauge at zero, and the sidecar still serves both reply kinds."""
        await self.wait_upstreams_closed()
        await self.wait_gauge_zero()
        self.prefill.faults.clear()
        self.decode.faults.clear()
        (await self.post(stream=True)).expect_ok(stream=True)
        (await self.post(Route.CHAT, stream=False)).expect_ok(stream=False)
        await self.wait_upstreams_closed()
        assert await self.inflight() == 0


#: Far above any wait in this suite: a sidecar that left a leg to the engine's own bootstrap
#: timeout fails the scenario instead of passing slowly.
ENGINE_TIMEOUTS: dict[str, Any] = {"bootstrap_timeout_s": 300.0, "waiting_timeout_s": 300.0}


def stub_config(engine: str, role: str, connector: str, **overrides: Any) -> StubConfig:
    return StubConfig(engine=engine, role=role, kv_connector=connector,
                      **{**ENGINE_TIMEOUTS, **overrides})


def faults(*items: dict[str, Any]) -> tuple[Fault, ...]:
    return tuple(Fault(kind=FaultKind(item["kind"]),
                       **{k: v for k, v in item.items() if k != "kind"}) for item in items)


# The one builder of a decode sidecar's settings (sidecar_builders), under the name these
# suites use.
sidecar_settings_for = decode_sidecar_settings


@contextlib.asynccontextmanager
async def started_stub(config: StubConfig) -> AsyncIterator[Stub]:
    stub = Stub(config)
    try:
        await stub.start()
        yield stub
    finally:
        await stub.stop()


@contextlib.asynccontextmanager
async def rig(
    engine: str = "vllm",
    connector: str = "shfs",
    *,
    prefill: dict[str, Any] | None = None,
    decode: dict[str, Any] | None = None,
    **settings: Any,
) -> AsyncIterator[Rig]:
    """The stubs and the sidecar; stub config overrides in ``prefill``/``decode``."""
    async with contextlib.AsyncExitStack() as stack:
        p = await stack.enter_async_context(
            started_stub(stub_config(engine, "prefill", connector, **(prefill or {}))))
        d = await stack.enter_async_context(
            started_stub(stub_config(engine, "decode", connector, **(decode or {}))))
        sc = await stack.enter_async_context(
            running_sidecar(**sidecar_settings_for(engine, connector, p, d, **settings)))
        client = await stack.enter_async_context(aiohttp.ClientSession())
        yield Rig(engine, connector, p, d, sc, client, stack)


# -- circuit breakers on a clock of the test's own --------------------------------------------

COMPLETIONS = Route.COMPLETIONS.value
A, B = PrefillTarget("10.0.0.1", 8000), PrefillTarget("10.0.0.2", 8000)


class Clock:
    """A clock that moves only when the test sets ``now``."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def breakers_of(clock: Clock, **overrides: Any) -> CircuitBreakers:
    """Breakers that open at the first failure and close at the first success, by default."""
    options = {"failures": 1, "open_s": 10.0, "successes": 1, **overrides}
    return CircuitBreakers(**options, clock=clock)


def fail(breakers: CircuitBreakers, target: PrefillTarget) -> None:
    """One failed leg to ``target``, admitted and settled."""
    admission = breakers.admit(target)
    assert admission is not None
    breakers.settle(target, admission, False, "HTTP 500")
