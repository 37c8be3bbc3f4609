"""Builders for the tracing flow tests: stub engines, two real sidecars, and client calls.

    async with traced_pd("vllm", otlp_endpoint=receiver.endpoint) as pd:
        await pd.http(...)                          HTTP PD request to the decode sidecar
        blocks = await pd.grpc_prefill(metadata)    Prefill on the prefill pod's sidecar
        await pd.grpc_decode(blocks, metadata)      Decode on the decode pod's sidecar
        pd.prefill_stub.recorder / pd.decode_stub.recorder

Both sidecars are the real ``serve.run_server`` (both front doors) from
``sidecar_builders``; leaving the block stops them, which flushes their spans.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
from openai_builders import client_body
from sidecar_builders import RunningSidecar, running_sidecar

from sidecar.grpc_gen import disagg_pb2, disagg_pb2_grpc
from sidecar.protocol.context import Route
from sidecar.tools.stubs.config import StubConfig
from sidecar.tools.stubs.server import Stub, run_stub

PROMPT_IDS = [72, 101, 108, 108, 111, 44, 32, 100, 105, 115, 97, 103, 103]
_CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0)]
Metadata = Sequence[tuple[str, str]]


@dataclass
class TracedPD:
    prefill_stub: Stub
    decode_stub: Stub
    prefill: RunningSidecar
    decode: RunningSidecar

    async def http(
        self,
        route: Route = Route.COMPLETIONS,
        *,
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, str]:
        """A PD request through the decode sidecar's HTTP front door."""
        sent = {"x-prefiller-host-port": f"127.0.0.1:{self.prefill_stub.port}", **(headers or {})}
        async with aiohttp.ClientSession() as session:
            async with session.post(
                self.decode.url + route.value, json=body or client_body(route), headers=sent
            ) as response:
                return response.status, await response.text()

    async def grpc_prefill(self, metadata: Metadata = ()) -> list[disagg_pb2.KVBlock]:
        address = f"127.0.0.1:{self.prefill.grpc_port}"
        async with grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS) as channel:
            call = disagg_pb2_grpc.PrefillWorkerStub(channel).Prefill(
                disagg_pb2.PreFillRequest(request_id="g-1", token_ids=PROMPT_IDS,
                                          max_new_tokens=4),
                metadata=tuple(metadata),
            )
            return [m.block async for m in call if m.HasField("block")]

    async def grpc_decode(
        self, blocks: list[disagg_pb2.KVBlock], metadata: Metadata = ()
    ) -> list[disagg_pb2.TokenStream]:
        address = f"127.0.0.1:{self.decode.grpc_port}"
        request = disagg_pb2.DecodeRequest(request_id="g-1", token_ids=PROMPT_IDS,
                                           max_new_tokens=4, kv_blocks=blocks)
        async with grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS) as channel:
            stub = disagg_pb2_grpc.DecodeWorkerStub(channel)
            return [m async for m in stub.Decode(request, metadata=tuple(metadata))]


@contextlib.asynccontextmanager
async def traced_pd(engine: str, connector: str = "shfs", **overrides: Any) -> AsyncIterator[
        TracedPD]:
    """Stub engines with a prefill-role and a decode-role sidecar; ``overrides`` go to both."""
    async with (
        run_stub(StubConfig(engine=engine, role="prefill", kv_connector=connector)) as p_stub,
        run_stub(StubConfig(engine=engine, role="decode", kv_connector=connector)) as d_stub,
    ):
        common: dict[str, Any] = {"engine": engine, "kv_connector": connector,
                                  "advertise_host": "127.0.0.1", **overrides}
        if p_stub.bootstrap_port:
            common["sglang_bootstrap_port"] = p_stub.bootstrap_port
            common["mooncake_bootstrap_port"] = p_stub.bootstrap_port
        async with (
            running_sidecar(engine_url=p_stub.url, role="prefill", **common) as prefill,
            running_sidecar(engine_url=d_stub.url, role="decode",
                            prefill_allowlist=(f"127.0.0.1:{p_stub.port}",), **common) as decode,
        ):
            yield TracedPD(p_stub, d_stub, prefill, decode)
