"""Builders for the gRPC front door tests: stub engines and sidecars on loopback, port 0.

    async with grpc_pd("sglang") as pd:
        result = await route(pd.prefill.address, pd.decode.address, PROMPT_IDS, 6)
        pd.prefill_stub.recorder / pd.decode_stub.recorder / pd.decode.metric(...)

Each sidecar is ``open_runtime`` + ``start_grpc_server`` in this process (no HTTP server), its
engine health checked once so the health service reports the stub's state.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from sidecar_builders import engine_settings, stub_pair

from sidecar.config.settings import Settings
from sidecar.grpc_gen import disagg_pb2, disagg_pb2_grpc
from sidecar.grpc_server.server import start_grpc_server
from sidecar.runtime import Runtime, open_runtime
from sidecar.tools.stubs.server import Stub
from sidecar.tools.stubs.textgen import PrefillKind, generate, prompt_digest

#: Every engine/connector pair the sidecar supports (the connector is ignored off vLLM).
PAIRS: list[tuple[str, str]] = [
    ("vllm", "shfs"),
    ("vllm", "nixl"),
    ("vllm", "mooncake"),
    ("vllm", "nixl-push"),
    ("sglang", "shfs"),
    ("trtllm", "shfs"),
]
PAIR_IDS = [f"{engine}-{connector}" if engine == "vllm" else engine for engine, connector in PAIRS]

PROMPT_IDS = [72, 101, 108, 108, 111, 44, 32, 100, 105, 115, 97, 103, 103]
CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0)]


def expected_tokens(prompt_ids: list[int], max_tokens: int) -> list[int]:
    """What a decode stub generates from a valid hand-off (textgen's REMOTE tokens)."""
    tokens, _ = generate(prompt_digest(prompt_ids), max_tokens, PrefillKind.REMOTE)
    return tokens


def closed_port() -> int:
    """A loopback port nothing listens on (bound by the OS, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class GrpcSidecar:
    runtime: Runtime
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metric(self, name: str, **labels: str) -> float:
        """The sum of samples ``name`` whose labels include ``labels`` (0 when absent)."""
        total = 0.0
        for family in self.runtime.metrics.registry.collect():
            for sample in family.samples:
                if sample.name == name and all(
                    sample.labels.get(key) == value for key, value in labels.items()
                ):
                    total += sample.value
        return total


@contextlib.asynccontextmanager
async def grpc_sidecar(engine_url: str, **overrides: Any) -> AsyncIterator[GrpcSidecar]:
    base: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "grpc_port": 0,
        "engine_url": engine_url,
        "advertise_host": "127.0.0.1",
        "log_level": "warning",
    }
    base.update(overrides)
    async with open_runtime(Settings(**base)) as runtime:
        await runtime.health.check()
        port, stop = await start_grpc_server(runtime)
        try:
            yield GrpcSidecar(runtime, port)
        finally:
            await stop(0.5)


@dataclass
class GrpcPD:
    engine: str
    connector: str
    prefill_stub: Stub
    decode_stub: Stub
    prefill: GrpcSidecar
    decode: GrpcSidecar


@contextlib.asynccontextmanager
async def grpc_pd(
    engine: str,
    connector: str = "shfs",
    *,
    prefill_stub: dict[str, Any] | None = None,
    decode_stub: dict[str, Any] | None = None,
    prefill_sidecar: dict[str, Any] | None = None,
    decode_sidecar: dict[str, Any] | None = None,
) -> AsyncIterator[GrpcPD]:
    """Two stub engines, each with its own sidecar: prefill role and decode role."""
    async with stub_pair(engine, connector, prefill=prefill_stub, decode=decode_stub) as (
        p_stub,
        d_stub,
    ):
        common = engine_settings(engine, connector, p_stub)
        async with (
            grpc_sidecar(p_stub.url, role="prefill", **common,
                         **(prefill_sidecar or {})) as p_side,
            grpc_sidecar(d_stub.url, role="decode", **common,
                         **(decode_sidecar or {})) as d_side,
        ):
            yield GrpcPD(engine, connector, p_stub, d_stub, p_side, d_side)


async def prefill_blocks(
    address: str, token_ids: list[int], *, request_id: str = "req-1", max_new_tokens: int = 6,
    deadline_s: float | None = None, metadata: tuple[tuple[str, str], ...] | None = None,
) -> list[disagg_pb2.KVBlock]:
    """Call Prefill and collect its blocks; read on past ``done`` to the RPC's end, so the
    server has finished its bookkeeping when this returns (tests read its metrics next)."""
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = disagg_pb2_grpc.PrefillWorkerStub(channel)
        blocks = []
        async for message in stub.Prefill(
            disagg_pb2.PreFillRequest(request_id=request_id, token_ids=token_ids,
                                      max_new_tokens=max_new_tokens),
            timeout=deadline_s, metadata=metadata,
        ):
            if message.HasField("block"):
                blocks.append(message.block)
        return blocks


async def decode_tokens(
    address: str, request: disagg_pb2.DecodeRequest, *, deadline_s: float | None = None,
    metadata: tuple[tuple[str, str], ...] | None = None,
) -> list[disagg_pb2.TokenStream]:
    """Call Decode and collect every message."""
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = disagg_pb2_grpc.DecodeWorkerStub(channel)
        return [message async for message in stub.Decode(request, timeout=deadline_s,
                                                           metadata=metadata)]


def rooms_in_flight(runtime: Runtime) -> int:
    """Bootstrap rooms the gRPC door's dialect holds (0 for dialects that have none)."""
    rooms = getattr(runtime.grpc_runner.dialect, "rooms", None)
    return 0 if rooms is None else int(rooms.in_flight())
