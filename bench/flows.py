"""One PD request as the load generator sends it: direct to the engines, or through the sidecar.

    Sidecar         POST sidecar (x-prefiller-host-port)                  ─▶ answer
    Router          POST a PD router (smg, vllm-router), which runs both legs ─▶ answer
    DirectSeq       POST prefill ─▶ POST decode with its hand-off       ─▶ answer (vLLM NIXL)
    DirectSGLang    POST prefill ║ POST decode, same bootstrap fields  ─▶ answer (SGLang)
    DirectMooncake  POST prefill ║ POST decode, one transfer_id        ─▶ answer (vLLM Mooncake)

The direct flows do what a router without a sidecar would do (what vLLM's reference proxy
and SGLang's mini load balancer do), so "through the sidecar minus direct" is the sidecar's
cost. ``Counted`` wraps any of them and counts its calls, so a run can check that each
request ran one prefill and one decode leg (the stubs count the legs they served).
Each call returns its latency, its time to the first body byte and, for streams, the
number of SSE events relayed. Calls go through a ``bench.http_clients.Http`` (the lean
client by default, aiohttp for comparison).

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

import orjson

from bench.http_clients import Http
from bench.lean_client import Origin

PATH = "/v1/completions"
CONTENT_TYPE = "application/json"
PROMPT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on."


@dataclass(slots=True)
class CallResult:
    ok: bool
    latency_s: float
    first_byte_s: float
    events: int
    gaps: list[float] | None = None  # token inter-arrival gaps, when the client times events


def client_body(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": "stub-model", "prompt": PROMPT, "max_tokens": max_tokens, "stream": stream}


def _headers() -> dict[str, str]:
    return {"content-type": CONTENT_TYPE, "x-request-id": uuid.uuid4().hex}


class Flow(Protocol):
    name: str

    async def call(self, http: Http) -> CallResult: ...


class Sidecar:
    """One request to the sidecar, which runs both legs."""

    def __init__(self, sidecar_url: str, prefill_port: int, max_tokens: int, stream: bool) -> None:
        self.name = "sidecar"
        self.origin = Origin.of_url(sidecar_url)
        self.stream = stream
        self.body = orjson.dumps(client_body(max_tokens, stream))
        self.headers = {
            "content-type": CONTENT_TYPE, "x-prefiller-host-port": f"127.0.0.1:{prefill_port}"
        }

    async def call(self, http: Http) -> CallResult:
        answer = await http.post(self.origin, PATH, self.headers, self.body, self.stream)
        return CallResult(
            answer.status == 200, answer.latency_s, answer.first_byte_s, answer.events,
            answer.gaps,
        )


class Router:
    """One request to a PD router that knows its prefill and decode engines (the anchors,
    ``bench.anchors``): the client's body as it is, no routing header."""

    def __init__(self, name: str, router_url: str, max_tokens: int, stream: bool) -> None:
        self.name = name
        self.origin = Origin.of_url(router_url)
        self.stream = stream
        self.body = orjson.dumps(client_body(max_tokens, stream))
        self.headers = {"content-type": CONTENT_TYPE}

    async def call(self, http: Http) -> CallResult:
        answer = await http.post(self.origin, PATH, self.headers, self.body, self.stream)
        return CallResult(
            answer.status == 200, answer.latency_s, answer.first_byte_s, answer.events,
            answer.gaps,
        )


class Counted:
    """A flow that counts the calls it started (each should be one PD request)."""

    def __init__(self, flow: Flow) -> None:
        self.flow = flow
        self.name = flow.name
        self.calls = 0

    async def call(self, http: Http) -> CallResult:
        self.calls += 1
        return await self.flow.call(http)


class DirectSeq:
    """vLLM NixlConnector as vLLM's reference proxy runs it: prefill, then decode."""

    def __init__(self, prefill_url: str, decode_url: str, max_tokens: int, stream: bool) -> None:
        self.name = "direct"
        self.prefill = Origin.of_url(prefill_url)
        self.decode = Origin.of_url(decode_url)
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

    async def call(self, http: Http) -> CallResult:
        started = time.perf_counter()
        headers = _headers()
        answer = await http.post(self.prefill, PATH, headers, self.prefill_body, False)
        params = None
        if answer.status == 200:
            params = orjson.loads(answer.body).get("kv_transfer_params")
        if not isinstance(params, dict):
            return CallResult(False, time.perf_counter() - started, 0.0, 0)
        # What a proxy must do across pods: point the decode at the prefill's address.
        params["remote_host"] = "127.0.0.1"
        body = orjson.dumps({**self.client, "kv_transfer_params": params})
        decode_started = time.perf_counter()
        answer = await http.post(self.decode, PATH, headers, body, self.stream)
        first = decode_started - started + answer.first_byte_s
        return CallResult(
            answer.status == 200, time.perf_counter() - started, first, answer.events,
            answer.gaps,
        )


class _DirectConcurrent:
    """Both legs at once; the answer is the decode's; the prefill is awaited too."""

    def __init__(self, prefill_url: str, decode_url: str, stream: bool) -> None:
        self.name = "direct"
        self.prefill = Origin.of_url(prefill_url)
        self.decode = Origin.of_url(decode_url)
        self.stream = stream

    def bodies(self) -> tuple[bytes, bytes]:
        raise NotImplementedError

    async def call(self, http: Http) -> CallResult:
        started = time.perf_counter()
        headers = _headers()
        prefill_body, decode_body = self.bodies()
        prefill = asyncio.ensure_future(
            http.post(self.prefill, PATH, headers, prefill_body, False)
        )
        try:
            answer = await http.post(self.decode, PATH, headers, decode_body, self.stream)
            latency = time.perf_counter() - started
            ok = answer.status == 200 and (await prefill).status == 200
        finally:
            if not prefill.done():
                prefill.cancel()
        return CallResult(ok, latency, answer.first_byte_s, answer.events, answer.gaps)


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
