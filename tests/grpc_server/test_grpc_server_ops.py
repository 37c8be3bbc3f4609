"""Proves the gRPC server's operations surface: the standard health service reports SERVING
only while the local engine answers its health check (and follows it both ways; draining
reports NOT_SERVING), ``serve`` runs the gRPC front door next to HTTP (a route through two
served sidecars works, and stopping them drains), reflection
lists both disagg services, the configured message size limit is enforced, and stop ends the
background prefills that are still running.

Does not prove SIGTERM handling of the whole process (``serve`` owns it; its tests run it).
"""

from __future__ import annotations

import grpc
import pytest
from grpc_builders import (
    CHANNEL_OPTIONS,
    PROMPT_IDS,
    closed_port,
    grpc_pd,
    grpc_sidecar,
    rooms_in_flight,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from sidecar.grpc_gen import disagg_pb2, disagg_pb2_grpc
from sidecar.grpc_server.server import DECODE_SERVICE, PREFILL_SERVICE
from sidecar.tools.stubs.faults import Fault, FaultKind
from sidecar.tools.stubs.server import run_stub

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _health(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = await stub.Check(health_pb2.HealthCheckRequest(service=service))
        return int(response.status)


async def test_health_follows_the_local_engine() -> None:
    async with run_stub(engine="vllm", role="decode") as stub:
        async with grpc_sidecar(stub.url) as sidecar:
            for service in ("", PREFILL_SERVICE, DECODE_SERVICE):
                assert await _health(sidecar.address, service) == SERVING
            stub.faults.set(Fault(FaultKind.STATUS, status=503, path="/health"))
            assert await sidecar.runtime.health.check() is False
            for service in ("", PREFILL_SERVICE, DECODE_SERVICE):
                assert await _health(sidecar.address, service) == NOT_SERVING
            stub.faults.clear()
            assert await sidecar.runtime.health.check() is True
            assert await _health(sidecar.address) == SERVING
            sidecar.runtime.admission.start_draining()
            assert await _health(sidecar.address, DECODE_SERVICE) == NOT_SERVING


async def test_health_is_not_serving_without_an_engine() -> None:
    async with grpc_sidecar(f"http://127.0.0.1:{closed_port()}") as sidecar:
        assert await _health(sidecar.address) == NOT_SERVING


async def test_reflection_lists_both_services() -> None:
    async with grpc_sidecar(f"http://127.0.0.1:{closed_port()}") as sidecar:
        async with grpc.aio.insecure_channel(sidecar.address, options=CHANNEL_OPTIONS) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)

            async def requests():  # type: ignore[no-untyped-def]
                yield reflection_pb2.ServerReflectionRequest(list_services="")

            names: set[str] = set()
            async for response in stub.ServerReflectionInfo(requests()):
                names |= {s.name for s in response.list_services_response.service}
        assert {"disagg.PrefillWorker", "disagg.DecodeWorker", "grpc.health.v1.Health"} <= names


async def test_message_size_limit_is_configured() -> None:
    async with grpc_sidecar(f"http://127.0.0.1:{closed_port()}",
                            grpc_max_message_bytes=64 * 1024) as sidecar:
        big = disagg_pb2.KVBlock(request_id="r", layer_idx=0, k_data=b"\0" * (100 * 1024))
        async with grpc.aio.insecure_channel(sidecar.address, options=CHANNEL_OPTIONS) as channel:
            call = disagg_pb2_grpc.DecodeWorkerStub(channel).Decode(
                disagg_pb2.DecodeRequest(request_id="r", kv_blocks=[big], token_ids=[1],
                                         max_new_tokens=1)
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call.read()
        assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_stop_cancels_background_prefills_and_releases_their_rooms() -> None:
    # The SGLang prefill engine waits for its decode, which never comes here.
    async with grpc_pd("sglang") as pd:
        async with grpc.aio.insecure_channel(pd.prefill.address, options=CHANNEL_OPTIONS) as ch:
            messages = [m async for m in disagg_pb2_grpc.PrefillWorkerStub(ch).Prefill(
                disagg_pb2.PreFillRequest(request_id="bg-1", token_ids=PROMPT_IDS))]
        assert messages[-1].done
        await pd.prefill_stub.recorder.next_request("/v1/completions")
        runtime = pd.prefill.runtime
        assert runtime.admission.inflight == 1  # the background prefill holds its slot
        assert rooms_in_flight(runtime) == 1
    assert runtime.admission.inflight == 0
    assert rooms_in_flight(runtime) == 0


async def test_metrics_are_labelled_grpc() -> None:
    async with grpc_pd("vllm") as pd:
        from grpc_builders import prefill_blocks

        await prefill_blocks(pd.prefill.address, PROMPT_IDS)
        assert pd.prefill.metric("disagg_inflight_requests", front_door="grpc") == 0
        assert pd.prefill.metric("disagg_stage_seconds_count", front_door="grpc",
                                 stage="prefill") == 1
        assert pd.prefill.metric("disagg_kv_bytes_total", direction="out") > 0
        assert pd.prefill.metric("disagg_requests_total", front_door="http") == 0


async def test_serve_runs_the_grpc_front_door_next_to_http() -> None:
    from grpc_builders import expected_tokens
    from sidecar_builders import running_sidecar

    from sidecar.tools.route import route

    async with (
        run_stub(engine="vllm", role="prefill") as p_stub,
        run_stub(engine="vllm", role="decode") as d_stub,
        running_sidecar(engine="vllm", engine_url=p_stub.url, role="prefill",
                        advertise_host="127.0.0.1") as prefill,
        running_sidecar(engine="vllm", engine_url=d_stub.url, role="decode") as decode,
    ):
        assert "grpc" in prefill.ports and "http" in prefill.ports
        result = await route(f"127.0.0.1:{prefill.grpc_port}", f"127.0.0.1:{decode.grpc_port}",
                             PROMPT_IDS, 4)
        assert result.token_ids == expected_tokens(PROMPT_IDS, 4)
        assert await decode.metric("disagg_requests_total", front_door="grpc", outcome="ok") == 1
