"""One PD request as the load generator sends it: direct to the engines, or through the sidecar.

    Sidecar         POST sidecar (x-prefiller-host-port)                  ─▶ answer
    DirectSeq       POST prefill ─▶ POST decode with its hand-off       ─▶ answer (vLLM NIXL)
    DirectSGLang    POST prefill ║ POST decode, same bootstrap fields  ─▶ answer (SGLang)
    DirectMooncake  POST prefill ║ POST decode, one transfer_id        ─▶ answer (vLLM Mooncake)

The direct flows do what a router without a sidecar would do (what vLLM's reference proxy
and SGLang's mini load balancer do), so "through the sidecar minus direct" is the sidecar's
cost. Each call returns its latency, its time to the first body byte and, for streams, the
number of SSE events relayed.

Deliberate limits: ``/v1/completions`` only; the answer is checked for status 200 and, for
streams, read to the end (the table counts anything else as an error), not parsed.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import orjson

PATH = "/v1/completions"
JSON_HEADERS = {"Content-Type": "application/json"}
PROMPT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on."


@dataclass(slots=True)
class CallResult:
    ok: bool
    latency_s: float
    first_byte_s: float
    events: int


def client_body(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": "stub-model", "prompt": PROMPT, "max_tokens": max_tokens, "stream": stream}


async def read_answer(
    response: aiohttp.ClientResponse, started: float, stream: bool
) -> tuple[float, int]:
    """Read a whole answer; returns (seconds to its first body byte, SSE events seen)."""
    if not stream:
        await response.read()
        return time.perf_counter() - started, 0
    first = 0.0
    events = 0
    last_newline = False
    async for chunk in response.content.iter_any():
        if not first:
            first = time.perf_counter() - started
        # Events end with a blank line; a "\n\n" may straddle two chunks.
        events += chunk.count(b"\n\n")
        if last_newline and chunk[:1] == b"\n":
            events += 1
        last_newline = chunk[-1:] == b"\n"
    return first, events


class Flow(Protocol):
    name: str

    async def call(self, session: aiohttp.ClientSession) -> CallResult: ...


class Sidecar:
    """One request to the sidecar, which runs both legs."""

    def __init__(self, sidecar_url: str, prefill_port: int, max_tokens: int, stream: bool) -> None:
        self.name = "sidecar"
        self.url = sidecar_url + PATH
        self.stream = stream
        self.body = orjson.dumps(client_body(max_tokens, stream))
        self.headers = {**JSON_HEADERS, "x-prefiller-host-port": f"127.0.0.1:{prefill_port}"}

    async def call(self, session: aiohttp.ClientSession) -> CallResult:
        started = time.perf_counter()
        async with session.post(self.url, data=self.body, headers=self.headers) as response:
            ok = response.status == 200
            first, events = await read_answer(response, started, self.stream)
        return CallResult(ok, time.perf_counter() - started, first, events)


class DirectSeq:
    """vLLM NixlConnector as vLLM's reference proxy runs it: prefill, then decode."""

    def __init__(self, prefill_url: str, decode_url: str, max_tokens: int, stream: bool) -> None:
        self.name = "direct"
        self.prefill_url = prefill_url + PATH
        self.decode_url = decode_url + PATH
        self.stream = stream
        self.client = client_body(max_tokens, stream)
        self.prefill_body = orjson.dumps({
            **self.client,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {
                "do_remote_decode": True, "do_remote_prefill": False,
                "remote_engine_id": None, "remote_block_ids": None,
                "remote_host": None, "remote_port": None,
            },
        })

    async def call(self, session: aiohttp.ClientSession) -> CallResult:
        started = time.perf_counter()
        headers = {**JSON_HEADERS, "X-Request-Id": uuid.uuid4().hex}
        async with session.post(
            self.prefill_url, data=self.prefill_body, headers=headers
        ) as response:
            ok = response.status == 200
            answer = orjson.loads(await response.read())
        params = answer.get("kv_transfer_params") if ok else None
        if not isinstance(params, dict):
            return CallResult(False, time.perf_counter() - started, 0.0, 0)
        # What a proxy must do across pods: point the decode at the prefill's address.
        params["remote_host"] = "127.0.0.1"
        body = orjson.dumps({**self.client, "kv_transfer_params": params})
        async with session.post(self.decode_url, data=body, headers=headers) as response:
            ok = response.status == 200
            first, events = await read_answer(response, started, self.stream)
        return CallResult(ok, time.perf_counter() - started, first, events)


class _DirectConcurrent:
    """Both legs at once; the answer is the decode's; the prefill is awaited too."""

    def __init__(self, prefill_url: str, decode_url: str, stream: bool) -> None:
        self.name = "direct"
        self.prefill_url = prefill_url + PATH
        self.decode_url = decode_url + PATH
        self.stream = stream

    def bodies(self) -> tuple[bytes, bytes]:
        raise NotImplementedError

    async def _prefill(self, session: aiohttp.ClientSession, body: bytes,
                       headers: dict[str, str]) -> bool:
        async with session.post(self.prefill_url, data=body, headers=headers) as response:
            await response.read()
            return response.status == 200

    async def call(self, session: aiohttp.ClientSession) -> CallResult:
        started = time.perf_counter()
        headers = {**JSON_HEADERS, "X-Request-Id": uuid.uuid4().hex}
        prefill_body, decode_body = self.bodies()
        prefill = asyncio.ensure_future(self._prefill(session, prefill_body, headers))
        try:
            async with session.post(
                self.decode_url, data=decode_body, headers=headers
            ) as response:
                ok = response.status == 200
                first, events = await read_answer(response, started, self.stream)
            latency = time.perf_counter() - started
            ok = await prefill and ok
        finally:
            if not prefill.done():
                prefill.cancel()
        return CallResult(ok, latency, first, events)


class DirectSGLang(_DirectConcurrent):
    """SGLang as its mini load balancer runs it: one body, a random room, both legs at once."""

    def __init__(self, prefill_url: str, decode_url: str, bootstrap_port: int,
                 max_tokens: int, stream: bool) -> None:
        super().__init__(prefill_url, decode_url, stream)
        self.client = client_body(max_tokens, stream)
        self.bootstrap_port = bootstrap_port

    def bodies(self) -> tuple[bytes, bytes]:
        body = orjson.dumps({
            **self.client,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": self.bootstrap_port,
            "bootstrap_room": random.getrandbits(63),
        })
        return body, body


class DirectMooncake(_DirectConcurrent):
    """vLLM MooncakeConnector as vLLM's Mooncake proxy runs it: one transfer id, both at once."""

    def __init__(self, prefill_url: str, decode_url: str, bootstrap_port: int, engine_id: str,
                 max_tokens: int, stream: bool) -> None:
        super().__init__(prefill_url, decode_url, stream)
        self.client = client_body(max_tokens, stream)
        self.bootstrap_addr = f"http://127.0.0.1:{bootstrap_port}"
        self.engine_id = engine_id
        self._ids = itertools.count()

    def bodies(self) -> tuple[bytes, bytes]:
        transfer_id = f"xfer-{next(self._ids)}-{uuid.uuid4().hex}"
        prefill = {
            **self.client, "max_tokens": 1, "stream": False,
            "kv_transfer_params": {
                "do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id,
            },
        }
        decode = {
            **self.client,
            "kv_transfer_params": {
                "do_remote_decode": False, "do_remote_prefill": True,
                "transfer_id": transfer_id, "remote_bootstrap_addr": self.bootstrap_addr,
                "remote_engine_id": self.engine_id,
            },
        }
        return orjson.dumps(prefill), orjson.dumps(decode)
