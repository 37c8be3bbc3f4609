"""Our generated code describes exactly the gRPC contract (docs/driving/grpc-contract.md#messages).

Proves: package ``disagg``; the two services with their server-streaming methods and the full
method names ``/disagg.PrefillWorker/Prefill`` and ``/disagg.DecodeWorker/Decode`` (both in the
descriptors and in the strings the generated stubs send); every message with exactly the
origin's field names, numbers, types and labels; repeated int32 packed. Does not prove wire
behaviour (test_grpc_wire, test_grpc_interop do).
"""

from __future__ import annotations

from typing import Any, cast

import grpc
import pytest
from google.protobuf import descriptor_pb2

from sidecar.grpc_gen import disagg_pb2, disagg_pb2_grpc

from .seed_contract import PACKAGE, SEED_MESSAGES, SEED_METHODS, field_proto


def _our_file() -> descriptor_pb2.FileDescriptorProto:
    return descriptor_pb2.FileDescriptorProto.FromString(disagg_pb2.DESCRIPTOR.serialized_pb)


def test_package_and_syntax() -> None:
    file = _our_file()
    assert file.package == PACKAGE
    assert file.syntax == "proto3"
    assert not file.dependency  # no imports: nothing else must be on a client's path


def test_exactly_the_seed_messages() -> None:
    assert [message.name for message in _our_file().message_type] == list(SEED_MESSAGES)


@pytest.mark.parametrize("message_name", list(SEED_MESSAGES))
def test_fields_match_the_seed_struct_tags(message_name: str) -> None:
    (message,) = [m for m in _our_file().message_type if m.name == message_name]
    ours = [
        (f.number, f.name, f.type, f.label, f.type_name, f.HasField("oneof_index"))
        for f in message.field
    ]
    seed = [
        (f.number, f.name, f.type, f.label, f.type_name, False)
        for f in map(field_proto, SEED_MESSAGES[message_name])
    ]
    assert ours == seed


@pytest.mark.parametrize(
    ("message", "field"),
    [(disagg_pb2.PreFillRequest, "token_ids"), (disagg_pb2.DecodeRequest, "token_ids")],
)
def test_repeated_int32_is_packed(message: Any, field: str) -> None:
    assert message.DESCRIPTOR.fields_by_name[field].is_packed


@pytest.mark.parametrize("full_name", list(SEED_METHODS))
def test_methods_in_the_descriptors(full_name: str) -> None:
    service_name, method_name, request, response = SEED_METHODS[full_name]
    service = disagg_pb2.DESCRIPTOR.services_by_name[service_name]
    method = service.methods_by_name[method_name]
    assert f"/{service.full_name}/{method.name}" == full_name
    assert method.input_type.full_name == f"{PACKAGE}.{request}"
    assert method.output_type.full_name == f"{PACKAGE}.{response}"
    method_proto = descriptor_pb2.MethodDescriptorProto()
    method.CopyToProto(method_proto)
    assert method_proto.server_streaming
    assert not method_proto.client_streaming


def test_exactly_two_services_with_one_method_each() -> None:
    services = disagg_pb2.DESCRIPTOR.services_by_name
    assert sorted(services) == ["DecodeWorker", "PrefillWorker"]
    assert {name: list(s.methods_by_name) for name, s in services.items()} == {
        "PrefillWorker": ["Prefill"],
        "DecodeWorker": ["Decode"],
    }


class _RecordingChannel:
    """Stands in for a channel: records what the generated stubs register."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def unary_stream(self, method: str, **_: Any) -> object:
        self.calls.append(("unary_stream", method))
        return object()

    def __getattr__(self, kind: str) -> Any:
        def record(method: str, **_: Any) -> object:
            self.calls.append((kind, method))
            return object()

        return record


def test_generated_stubs_call_the_seed_method_names() -> None:
    channel = _RecordingChannel()
    disagg_pb2_grpc.PrefillWorkerStub(cast(grpc.Channel, channel))
    disagg_pb2_grpc.DecodeWorkerStub(cast(grpc.Channel, channel))
    assert channel.calls == [("unary_stream", name) for name in SEED_METHODS]
