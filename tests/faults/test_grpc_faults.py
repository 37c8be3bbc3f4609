"""Proves how the gRPC front door answers engines and routers that misbehave, for every
engine pair: a router calls Prefill on the prefill pod's sidecar and Decode on the decode
pod's sidecar (two real sidecars, each before its stub engine), and a fault strikes one leg.

Each scenario asserts the gRPC status the router gets (and, for a stream that broke after
tokens, that tokens came first), that both engines have nothing in flight, that both
sidecars' in-flight gauges (``front_door="grpc"``) returned to zero and that a clean
Prefill+Decode round trip works afterwards.

On concurrent pairs (SGLang, vLLM Mooncake) Prefill answers with the hand-off at once and
its engine call runs in the background; a failure there cannot reach the decode, which runs
on another sidecar: the decode is bounded by its own read deadline (DEADLINE_EXCEEDED), a
documented limit of the gRPC contract, asserted here so a change is noticed.

Does not repeat tests/grpc_server/test_grpc_errors.py (message checks, single-sidecar
failures); it adds the cross-sidecar picture and the after-conditions.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from fault_builders import (
    CONCURRENT,
    PAIRS,
    engine_param,
    eventually,
    faults,
    started_stub,
    stub_config,
)
from sidecar_builders import RunningSidecar, running_sidecar

from sidecar.grpc_gen import disagg_pb2, disagg_pb2_grpc
from sidecar.tools.stubs.server import Stub

PROMPT_IDS = [72, 101, 108, 108, 111, 44, 32, 100, 105, 115]
OPTIONS = [("grpc.enable_http_proxy", 0)]
#: Deadlines of the sidecars: short only where a row waits for one (hang, stall, background).
SHORT = {"prefill_timeout_s": 1.0, "read_timeout_s": 1.0}


@dataclass
class GrpcRig:
    engine: str
    connector: str
    prefill: Stub
    decode: Stub
    p_side: RunningSidecar
    d_side: RunningSidecar
    channels: contextlib.AsyncExitStack

    async def _stubs(self, side: RunningSidecar) -> tuple[Any, Any]:
        channel = await self.channels.enter_async_context(
            grpc.aio.insecure_channel(f"127.0.0.1:{side.grpc_port}", options=OPTIONS))
        return (disagg_pb2_grpc.PrefillWorkerStub(channel),
                disagg_pb2_grpc.DecodeWorkerStub(channel))

    async def prefill_call(self, *, deadline_s: float | None = 10.0) -> list[disagg_pb2.KVBlock]:
        prefill, _ = await self._stubs(self.p_side)
        blocks = []
        async for message in prefill.Prefill(
            disagg_pb2.PreFillRequest(request_id="fault", token_ids=PROMPT_IDS,
                                      max_new_tokens=6), timeout=deadline_s):
            if message.HasField("block"):
                blocks.append(message.block)
        return blocks

    def decode_call(self, blocks: list[disagg_pb2.KVBlock], decode: Any,
                    *, timeout: float | None = 10.0) -> Any:
        return decode.Decode(
            disagg_pb2.DecodeRequest(request_id="fault", kv_blocks=blocks,
                                     token_ids=PROMPT_IDS, max_new_tokens=6), timeout=timeout)

    async def round_trip(self) -> tuple[list[int], grpc.StatusCode]:
        """Prefill then Decode; the tokens received and the final status."""
        tokens: list[int] = []
        try:
            blocks = await self.prefill_call()
            _, decode = await self._stubs(self.d_side)
            async for message in self.decode_call(blocks, decode):
                if not message.done:
                    tokens.append(message.token_id)
        except grpc.aio.AioRpcError as error:
            return tokens, error.code()
        return tokens, grpc.StatusCode.OK

    async def check_recovered(self) -> None:
        await self.prefill.wait_idle()
        await self.decode.wait_idle()
        for side in (self.p_side, self.d_side):
            async def zero(side: RunningSidecar = side) -> bool:
                return await side.metric("disagg_inflight_requests", front_door="grpc") == 0

            await eventually(zero)
        self.prefill.faults.clear()
        self.decode.faults.clear()
        tokens, code = await self.round_trip()
        assert code is grpc.StatusCode.OK and len(tokens) == 6, (code, tokens)


@contextlib.asynccontextmanager
async def grpc_rig(engine: str, connector: str, *, prefill: dict[str, Any] | None = None,
                   decode: dict[str, Any] | None = None,
                   **settings: Any) -> AsyncIterator[GrpcRig]:
    async with contextlib.AsyncExitStack() as stack:
        p = await stack.enter_async_context(
            started_stub(stub_config(engine, "prefill", connector, **(prefill or {}))))
        d = await stack.enter_async_context(
            started_stub(stub_config(engine, "decode", connector, **(decode or {}))))
        common: dict[str, Any] = {"engine": engine, "kv_connector": connector, **settings}
        if p.bootstrap_port:
            common["sglang_bootstrap_port"] = p.bootstrap_port
            common["mooncake_bootstrap_port"] = p.bootstrap_port
        p_side = await stack.enter_async_context(running_sidecar(
            engine_url=p.url, role="prefill", advertise_host="127.0.0.1", **common))
        d_side = await stack.enter_async_context(running_sidecar(
            engine_url=d.url, role="decode", **common))
        channels = await stack.enter_async_context(contextlib.AsyncExitStack())
        yield GrpcRig(engine, connector, p, d, p_side, d_side, channels)


@dataclass(frozen=True)
class GrpcFault:
    name: str
    leg: str
    fault: dict[str, Any]
    code: grpc.StatusCode
    tokens_first: bool = False  # the stream broke after tokens were relayed


UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
INVALID = grpc.StatusCode.INVALID_ARGUMENT
DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED

#: Prefill-engine faults the Prefill RPC itself reports (sequential pairs).
PREFILL_ROWS = [
    GrpcFault("prefill-engine-500", "prefill", {"kind": "status", "status": 500}, UNAVAILABLE),
    GrpcFault("prefill-engine-422", "prefill", {"kind": "status", "status": 422}, INVALID),
    GrpcFault("prefill-engine-hang", "prefill", {"kind": "hang"}, DEADLINE),
    GrpcFault("prefill-engine-garbage", "prefill", {"kind": "malformed"}, UNAVAILABLE),
    GrpcFault("prefill-engine-reset", "prefill", {"kind": "drop"}, UNAVAILABLE),
]
#: Decode-engine faults, for every pair.
DECODE_ROWS = [
    GrpcFault("decode-engine-500", "decode", {"kind": "status", "status": 500}, UNAVAILABLE),
    GrpcFault("decode-engine-400", "decode", {"kind": "status", "status": 400}, INVALID),
    GrpcFault("decode-engine-hang", "decode", {"kind": "hang"}, DEADLINE),
    GrpcFault("decode-reset-mid-stream", "decode", {"kind": "drop", "after_chunks": 2},
              UNAVAILABLE, tokens_first=True),
    GrpcFault("decode-stall-mid-stream", "decode", {"kind": "stall", "after_chunks": 2},
              DEADLINE, tokens_first=True),
    GrpcFault("decode-cut-stream", "decode", {"kind": "truncate", "after_chunks": 2},
              UNAVAILABLE, tokens_first=True),
]
#: On concurrent pairs a failed background prefill leaves the decode to its read deadline.
CONCURRENT_PREFILL_ROWS = [
    GrpcFault("background-prefill-500", "prefill", {"kind": "status", "status": 500}, DEADLINE),
]


def _cases() -> list[Any]:
    cases = []
    for engine, connector in PAIRS:
        concurrent = (engine, connector) in CONCURRENT
        rows = DECODE_ROWS + (CONCURRENT_PREFILL_ROWS if concurrent else PREFILL_ROWS)
        cases += [engine_param(engine, connector, row.name, row) for row in rows]
    return cases


@pytest.mark.parametrize(("engine", "connector", "name", "row"), _cases())
async def test_grpc_leg_fault(engine: str, connector: str, name: str, row: GrpcFault) -> None:
    # On concurrent pairs a decode that fails before it connects leaves the prefill engine
    # waiting for it: the prefill sidecar's deadline is what ends that call.
    concurrent = (engine, connector) in CONCURRENT
    deadlines = SHORT if row.code is DEADLINE or concurrent else {}
    async with grpc_rig(engine, connector, **{row.leg: {"faults": faults({**row.fault,
                                                                          "times": 1})}},
                        **deadlines) as r:
        tokens, code = await r.round_trip()
        assert code is row.code, (code, tokens)
        if row.tokens_first:
            assert tokens, "the stream should have relayed tokens before it broke"
        await r.check_recovered()


@pytest.mark.parametrize(("engine", "connector"), [engine_param(e, c) for e, c in PAIRS])
async def test_router_cancels_decode_mid_stream(engine: str, connector: str) -> None:
    async with grpc_rig(engine, connector, read_timeout_s=30.0,
                        decode={"faults": faults({"kind": "stall", "after_chunks": 2,
                                                  "times": 1})}) as r:
        blocks = await r.prefill_call()
        _, decode = await r._stubs(r.d_side)
        call = r.decode_call(blocks, decode)
        first = await call.read()
        assert first.token_id >= 0 and not first.done
        call.cancel()
        await r.decode.wait_idle()
        assert r.decode.recorder.cancelled >= 1
        await r.check_recovered()


async def test_router_deadline_on_prefill_ends_the_engine_call() -> None:
    async with grpc_rig("vllm", "shfs", prefill_timeout_s=30.0,
                        prefill={"faults": faults({"kind": "hang", "times": 1})}) as r:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await r.prefill_call(deadline_s=0.3)
        assert caught.value.code() is DEADLINE
        await r.prefill.wait_idle()
        assert r.prefill.recorder.cancelled == 1
        await r.check_recovered()


async def test_grpc_over_max_inflight_is_resource_exhausted() -> None:
    async with grpc_rig("vllm", "shfs", max_inflight=1, prefill_timeout_s=30.0,
                        prefill={"faults": faults({"kind": "hang", "times": 1})}) as r:
        stuck = asyncio.ensure_future(r.prefill_call())
        await r.prefill.recorder.next_request("/v1/completions")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await r.prefill_call()
        assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        stuck.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await stuck
        await r.check_recovered()
