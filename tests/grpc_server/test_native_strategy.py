"""Proves the gRPC door's native hand-off strategy (sidecar/grpc_server/native.py) without a
server or an engine: the seams between the RPC messages, the PD flow and the control blocks.

- ``NativeDecode``: the decode body is built from the request (model, token ids, max tokens,
  temperature as its shortest float32 decimal, streamed, the dialect's token-id fields) and
  the hand-off carried in the control blocks, merged as the HTTP door merges one (the
  hand-off's fields win); the request id is the request's, else the hand-off's; the blocks'
  bytes are counted in; a hand-off from another engine or KV connector is refused
  (FAILED_PRECONDITION, stage handoff) before anything is asked of the engine;
- ``NativePrefill`` over a fake flow: the client body it hands ``prefill_only`` (an unset
  ``max_new_tokens`` is one token), this pod's engine as the target with the advertise host,
  the request id in the headers and the caller's remaining time; the hand-off's fields go
  out as control blocks naming the dialect, the pod and the request; without an advertise
  host (a loopback engine) the Prefill is refused before the flow runs; a bad request is
  refused before it too;
- both on real flows (TensorRT-LLM, fake engine calls): what the prefill side sends is what
  the decode side merges.

It does not prove the gRPC services around the strategy (admission, deadlines, status
mapping, the stream: tests/grpc_server over stubs).
"""

from __future__ import annotations

import contextlib
from typing import Any, cast

import pytest
from flow_builders import FakeCalls, flow_of, sample, scopes_of
from protocol_builders import FIXED_NOW_MS, make_dialect

from sidecar.config.settings import Settings
from sidecar.dialects import Dialect
from sidecar.dialects.sglang import SGLangDialect
from sidecar.dialects.trtllm import TRTLLMDialect, snowflake_id
from sidecar.dialects.vllm_mooncake import MooncakeDialect
from sidecar.dialects.vllm_nixl import NixlPullDialect
from sidecar.errors import FailedPrecondition, InvalidRequest, Stage
from sidecar.grpc_gen import disagg_pb2
from sidecar.grpc_server.decode import DecodeInput
from sidecar.grpc_server.native import NativeDecode, NativePrefill, decode_handoff, encode_handoff
from sidecar.grpc_server.prefill import PrefillCall
from sidecar.observability.metrics import Metrics
from sidecar.protocol.context import PrefillTarget
from sidecar.request.runner import Handoff, Runner
from sidecar.request.scope import Admission

NIXL_FIELDS: dict[str, Any] = {"kv_transfer_params": {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2],
    "remote_engine_id": "engine-p", "remote_request_id": "p-1", "remote_host": "10.0.0.9",
    "remote_port": 5600}}


def blocks_of(fields: dict[str, Any], *, engine: str = "vllm", connector: str | None = "shfs",
              request_id: str = "rq-handoff") -> list[disagg_pb2.KVBlock]:
    return encode_handoff(fields, request_id=request_id, engine=engine, kv_connector=connector,
                          prefill_host="10.0.0.9", prefill_port=8000, max_chunk_bytes=64)


def decode_request(blocks: list[disagg_pb2.KVBlock], request_id: str = "rq-1",
                   max_new_tokens: int = 8) -> disagg_pb2.DecodeRequest:
    return disagg_pb2.DecodeRequest(request_id=request_id, kv_blocks=blocks,
                                    token_ids=[5, 6, 7], max_new_tokens=max_new_tokens,
                                    temperature=0.7)


PREFILL = "/disagg.PrefillWorker/Prefill"


async def decode_body(dialect: Dialect, request: disagg_pb2.DecodeRequest | bytes,
                      metrics: Metrics | None = None) -> tuple[dict[str, Any], str]:
    native = NativeDecode(flow_of(dialect, FakeCalls()), metrics or Metrics())
    async with contextlib.AsyncExitStack() as exits:
        return await native.decode_body(native.read(request), exits)


# -- NativeDecode ---------------------------------------------------------------------------


async def test_the_decode_body_is_the_request_plus_the_hand_off() -> None:
    metrics = Metrics()
    blocks = blocks_of(NIXL_FIELDS)
    assert len(blocks) > 1  # chunked: the blocks are reassembled
    body, request_id = await decode_body(make_dialect(NixlPullDialect), decode_request(blocks),
                                         metrics)
    assert body == {"model": "m", "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0.7,
                    "stream": True, "return_token_ids": True, **NIXL_FIELDS}
    assert request_id == "rq-1"
    assert sample(metrics, "disagg_kv_bytes_total", direction="in") == sum(
        len(block.k_data) for block in blocks)


async def test_the_request_id_falls_back_to_the_hand_offs() -> None:
    request = decode_request(blocks_of(NIXL_FIELDS, request_id="rq-handoff"), request_id="")
    _, request_id = await decode_body(make_dialect(NixlPullDialect), request)
    assert request_id == "rq-handoff"


async def test_the_hand_offs_fields_win_and_token_id_fields_are_the_dialects() -> None:
    fields = {"disaggregated_params": {"request_type": "generation_only",
                                       "disagg_request_id": 2**62 + 1},
              "prompt": [9, 9, 9]}
    request = decode_request(blocks_of(fields, engine="trtllm", connector=None))
    body, _ = await decode_body(make_dialect(TRTLLMDialect), request.SerializeToString())
    assert body["prompt"] == [9, 9, 9]  # the context's token ids, as over HTTP
    assert body["disaggregated_params"]["disagg_request_id"] == 2**62 + 1
    assert body["detokenize"] is False and "return_token_ids" not in body


@pytest.mark.parametrize(("dialect_cls", "engine", "connector", "refused"), [
    (NixlPullDialect, "sglang", None, "sglang"),
    (NixlPullDialect, "vllm", "mooncake", "mooncake"),
    (MooncakeDialect, "vllm", "shfs", "shfs"),
    (SGLangDialect, "sglang", "shfs", "shfs"),
    (SGLangDialect, "trtllm", None, "trtllm"),
])
async def test_a_hand_off_of_another_engine_or_connector_is_refused(
    dialect_cls: type[Dialect], engine: str, connector: str | None, refused: str
) -> None:
    calls = FakeCalls()
    native = NativeDecode(flow_of(make_dialect(dialect_cls), calls), Metrics())
    request = decode_request(blocks_of({}, engine=engine, connector=connector))
    with pytest.raises(FailedPrecondition) as raised:
        await native.decode_body(DecodeInput(request), contextlib.AsyncExitStack())
    assert raised.value.stage is Stage.HANDOFF
    assert repr(refused) in raised.value.message
    assert calls.decodes == [] and calls.prefills == []


async def test_the_same_engine_and_connector_pass() -> None:
    body, _ = await decode_body(make_dialect(SGLangDialect),
                                decode_request(blocks_of({"bootstrap_room": 7},
                                                         engine="sglang", connector=None)))
    assert body["bootstrap_room"] == 7


# -- NativePrefill over a fake flow -----------------------------------------------------------


class FakeFlow:
    """The surface ``NativePrefill`` uses: ``dialect``, ``calls.model_name``, ``prefill_only``."""

    def __init__(self, dialect: Dialect, fields: dict[str, Any]) -> None:
        self.dialect = dialect
        self.calls = FakeCalls(model="served-model")
        self.fields = fields
        self.seen: list[tuple[dict[str, Any], dict[str, Any]]] = []

    async def prefill_only(self, client_body: dict[str, Any], **kwargs: Any) -> Handoff:
        self.seen.append((client_body, kwargs))
        return Handoff(dict(self.fields))


class Sent:
    def __init__(self) -> None:
        self.messages: list[tuple[disagg_pb2.KVBlockStream, int]] = []

    async def __call__(self, message: Any, nbytes: int) -> None:
        self.messages.append((message, nbytes))

    @property
    def blocks(self) -> list[disagg_pb2.KVBlock]:
        return [message.block for message, _ in self.messages]


def native_prefill(flow: FakeFlow, **settings: Any) -> tuple[NativePrefill, Any]:
    scopes = scopes_of(Metrics(), Admission(4), front_door="grpc")
    options = {"engine": flow.dialect.engine, "engine_url": "http://127.0.0.1:30000",
               "advertise_host": "10.0.0.9", **settings}
    native = NativePrefill(cast(Runner, flow), scopes, Settings.model_validate(options))
    return native, scopes


def prefill_request(**fields: Any) -> disagg_pb2.PreFillRequest:
    values = {"request_id": "rq-1", "token_ids": [5, 6, 7], "max_new_tokens": 0,
              "temperature": 0.0, **fields}
    return disagg_pb2.PreFillRequest(**values)


async def test_prefill_hands_the_flow_the_client_body_and_sends_the_hand_off() -> None:
    fields = {"bootstrap_host": "10.0.0.9", "bootstrap_port": 8998, "bootstrap_room": 41}
    flow = FakeFlow(make_dialect(SGLangDialect), fields)
    native, scopes = native_prefill(flow)
    scope = scopes.open("/disagg.PrefillWorker/Prefill", "rq-1")
    sent = Sent()

    await native.run(PrefillCall(prefill_request(), scope, 2.5, sent))

    ((client_body, kwargs),) = flow.seen
    assert client_body == {"model": "served-model", "prompt": [5, 6, 7], "max_tokens": 1,
                           "temperature": 0.0, "return_token_ids": True}
    assert kwargs["request_id"] == "rq-1"
    assert kwargs["target"] == PrefillTarget("10.0.0.9", 30000)
    assert kwargs["advertise_host"] == "10.0.0.9"
    assert kwargs["headers"] == {"X-Request-Id": "rq-1"}
    assert kwargs["time_remaining"] == 2.5
    assert kwargs["scope"] is scope and kwargs["scopes"] is scopes
    handoff = decode_handoff(sent.blocks)
    assert handoff.fields == fields
    assert (handoff.engine, handoff.kv_connector) == ("sglang", None)
    assert (handoff.prefill_host, handoff.prefill_port) == ("10.0.0.9", 30000)
    assert handoff.request_id == "rq-1"
    assert [nbytes for _, nbytes in sent.messages] == [len(b.k_data) for b in sent.blocks]


async def test_prefill_keeps_an_asked_token_count_and_makes_a_request_id() -> None:
    flow = FakeFlow(make_dialect(NixlPullDialect), NIXL_FIELDS)
    native, scopes = native_prefill(flow)
    sent = Sent()
    await native.run(PrefillCall(prefill_request(request_id="", max_new_tokens=4),
                     scopes.open(PREFILL), None, sent))
    ((client_body, kwargs),) = flow.seen
    assert client_body["max_tokens"] == 4
    request_id = kwargs["request_id"]
    assert request_id and kwargs["headers"] == {"X-Request-Id": request_id}
    handoff = decode_handoff(sent.blocks)
    assert handoff.request_id == request_id
    assert (handoff.engine, handoff.kv_connector) == ("vllm", "shfs")


async def test_prefill_without_an_advertise_host_is_refused_before_the_flow() -> None:
    flow = FakeFlow(make_dialect(NixlPullDialect), {})
    native, scopes = native_prefill(flow, advertise_host=None)
    with pytest.raises(FailedPrecondition):
        await native.run(PrefillCall(prefill_request(), scopes.open(PREFILL),
                         None, Sent()))
    assert flow.seen == []
    # A non-loopback engine URL names the pod itself.
    named, scopes = native_prefill(flow, advertise_host=None,
                                   engine_url="http://10.0.0.5:8000")
    await named.run(PrefillCall(prefill_request(), scopes.open(PREFILL), None,
                    Sent()))
    assert flow.seen[0][1]["target"] == PrefillTarget("10.0.0.5", 8000)


@pytest.mark.parametrize("fields", [{"token_ids": []}, {"token_ids": [1, -1]},
                                    {"max_new_tokens": -1}, {"temperature": -0.5}])
async def test_a_bad_prefill_request_is_refused_before_the_flow(fields: dict[str, Any]) -> None:
    flow = FakeFlow(make_dialect(NixlPullDialect), {})
    native, scopes = native_prefill(flow)
    with pytest.raises(InvalidRequest):
        await native.run(PrefillCall(prefill_request(**fields), scopes.open(PREFILL),
                         None, Sent()))
    assert flow.seen == []


# -- both halves on real flows ----------------------------------------------------------------


async def test_what_the_prefill_side_sends_is_what_the_decode_side_merges() -> None:
    disagg_id = snowflake_id(FIXED_NOW_MS, 0, 0)
    prefill_calls = FakeCalls()
    prefill_flow = flow_of(make_dialect(TRTLLMDialect), prefill_calls)
    prefill_calls.prefill_answers({
        "choices": [{"text": "", "finish_reason": "length",
                     "disaggregated_params": {"request_type": "context_only",
                                              "disagg_request_id": disagg_id}}],
        "prompt_token_ids": [5, 6, 7]})
    scopes = scopes_of(Metrics(), Admission(4), front_door="grpc")
    native = NativePrefill(prefill_flow, scopes, Settings(engine="trtllm",
                                                          advertise_host="10.0.0.9"))
    scope = scopes.open("/disagg.PrefillWorker/Prefill", "rq-1")
    scope.admit()
    sent = Sent()
    await native.run(PrefillCall(prefill_request(), scope, None, sent))
    assert prefill_calls.prefills[0].body["disaggregated_params"] == {
        "request_type": "context_only", "disagg_request_id": disagg_id}

    body, request_id = await decode_body(make_dialect(TRTLLMDialect),
                                         decode_request(sent.blocks, request_id=""))
    assert request_id == "rq-1"
    assert body == {"model": "m", "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0.7,
                    "stream": True, "detokenize": False,
                    "disaggregated_params": {"request_type": "generation_only",
                                             "disagg_request_id": disagg_id}}
