"""Builders for the HTTP front door tests: a stub prefill/decode pair and the sidecar before it.

    async with pd_pair("sglang") as pair:
        status, headers, text = await pair.send(stream=True)
        pair.prefill.recorder / pair.decode.recorder / await pair.sidecar.metric(...)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from multidict import CIMultiDict
from openai_builders import client_body
from sidecar_builders import RunningSidecar, decode_sidecar_settings, running_sidecar, stub_pair

from sidecar.protocol.context import Route
from sidecar.tools.stubs.server import Stub

#: Every engine/connector pair the sidecar supports.
PAIRS: list[tuple[str, str]] = [
    ("vllm", "shfs"),
    ("vllm", "nixl"),
    ("vllm", "mooncake"),
    ("vllm", "nixl-push"),
    ("sglang", "shfs"),
    ("trtllm", "shfs"),
]

__all__ = ["PAIRS", "PDPair", "client_body", "metric_reaches", "pd_pair", "sse_events",
           "streamed_text"]


@dataclass
class PDPair:
    engine: str
    connector: str
    prefill: Stub
    decode: Stub
    sidecar: RunningSidecar

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.prefill.port}"

    async def send(
        self,
        route: Route = Route.COMPLETIONS,
        *,
        stream: bool = False,
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        with_target: bool = True,
    ) -> tuple[int, CIMultiDict[str], str]:
        payload = body if body is not None else client_body(route, stream=stream)
        sent_headers = {"x-prefiller-host-port": self.target} if with_target else {}
        sent_headers.update(headers or {})
        async with aiohttp.ClientSession() as session:
            async with session.post(
                self.sidecar.url + route.value, json=payload, headers=sent_headers
            ) as response:
                return response.status, CIMultiDict(response.headers), await response.text()


@contextlib.asynccontextmanager
async def pd_pair(
    engine: str,
    connector: str = "shfs",
    *,
    prefill_overrides: dict[str, Any] | None = None,
    decode_overrides: dict[str, Any] | None = None,
    **sidecar_overrides: Any,
) -> AsyncIterator[PDPair]:
    async with stub_pair(
        engine, connector, prefill=prefill_overrides, decode=decode_overrides
    ) as (prefill, decode):
        settings = decode_sidecar_settings(engine, connector, prefill, decode, **sidecar_overrides)
        async with running_sidecar(**settings) as sidecar:
            yield PDPair(engine, connector, prefill, decode, sidecar)


def sse_events(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    return [line[6:] for line in text.split("\n") if line.startswith("data: ")]


def streamed_text(text: str) -> str:
    pieces = []
    for event in sse_events(text):
        if event == "[DONE]":
            continue
        for choice in json.loads(event).get("choices", []):
            pieces.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(pieces)


def json_text(text: str) -> str:
    choice = json.loads(text)["choices"][0]
    return str(choice.get("text") or (choice.get("message") or {}).get("content") or "")


async def metric_reaches(
    sidecar: RunningSidecar, name: str, value: float, *, timeout_s: float = 10.0,
    **labels: str,
) -> None:
    """Wait until a metric reads ``value`` (a request is counted after its last byte left).

    Polls the real exposition: the state decides, and a broken test fails at ``timeout_s``.
    """
    async with asyncio.timeout(timeout_s):
        # Metrics are only observable by scraping /metrics: there is no event to wait on.
        while await sidecar.metric(name, **labels) != value:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
