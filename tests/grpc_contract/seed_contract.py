"""A second, independent copy of the gRPC contract (docs/driving/grpc-contract.md#origin: zerfoo's
``disaggpb``),
written from the Go struct tags.

The seed (shared/seeds/000_*.txt, package ``disaggpb``) gives each field as a struct tag, e.g.
``protobuf:"varint,2,rep,packed,name=token_ids"``. ``SEED_MESSAGES`` transcribes those tags
by hand; ``independent_classes()`` builds message classes from them in a private descriptor
pool, so the interop tests have a client and a server that share no code with
``sidecar.grpc_gen`` (not the proto, not protoc's output, not the default pool).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "disagg"

_TYPES = {
    "string": descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
    "bytes": descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
    "int32": descriptor_pb2.FieldDescriptorProto.TYPE_INT32,
    "float": descriptor_pb2.FieldDescriptorProto.TYPE_FLOAT,
    "bool": descriptor_pb2.FieldDescriptorProto.TYPE_BOOL,
}


@dataclass(frozen=True)
class SeedField:
    """One field as the origin's Go struct tag gives it."""

    number: int
    name: str
    #: A scalar type name of ``_TYPES``, or the name of a message of the package.
    type: str
    repeated: bool = False


SEED_MESSAGES: dict[str, tuple[SeedField, ...]] = {
    "PreFillRequest": (
        SeedField(1, "request_id", "string"),
        SeedField(2, "token_ids", "int32", repeated=True),
        SeedField(3, "max_new_tokens", "int32"),
        SeedField(4, "temperature", "float"),
    ),
    "KVBlock": (
        SeedField(1, "request_id", "string"),
        SeedField(2, "layer_idx", "int32"),
        SeedField(3, "block_idx", "int32"),
        SeedField(4, "k_data", "bytes"),
        SeedField(5, "v_data", "bytes"),
    ),
    "KVBlockStream": (
        SeedField(1, "block", "KVBlock"),
        SeedField(2, "done", "bool"),
    ),
    "DecodeRequest": (
        SeedField(1, "request_id", "string"),
        SeedField(2, "kv_blocks", "KVBlock", repeated=True),
        SeedField(3, "token_ids", "int32", repeated=True),
        SeedField(4, "max_new_tokens", "int32"),
        SeedField(5, "temperature", "float"),
    ),
    "TokenStream": (
        SeedField(1, "request_id", "string"),
        SeedField(2, "token_id", "int32"),
        SeedField(3, "done", "bool"),
        SeedField(4, "finish_reason", "string"),
    ),
}

#: Full method name -> (service, method, request, response); all are server-streaming.
SEED_METHODS: dict[str, tuple[str, str, str, str]] = {
    "/disagg.PrefillWorker/Prefill": (
        "PrefillWorker",
        "Prefill",
        "PreFillRequest",
        "KVBlockStream",
    ),
    "/disagg.DecodeWorker/Decode": ("DecodeWorker", "Decode", "DecodeRequest", "TokenStream"),
}


def field_proto(field: SeedField) -> descriptor_pb2.FieldDescriptorProto:
    """The FieldDescriptorProto a proto3 compiler would write for ``field``."""
    proto = descriptor_pb2.FieldDescriptorProto(
        name=field.name,
        number=field.number,
        label=(
            descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
            if field.repeated
            else descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL
        ),
    )
    if field.type in _TYPES:
        proto.type = _TYPES[field.type]
    else:
        proto.type = descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE
        proto.type_name = f".{PACKAGE}.{field.type}"
    return proto


def independent_file() -> descriptor_pb2.FileDescriptorProto:
    """The contract as a FileDescriptorProto, built from ``SEED_MESSAGES`` alone."""
    file = descriptor_pb2.FileDescriptorProto(
        # Named like the origin's file; it lives in a private pool, so no clash with ours.
        name="serve/disaggregated/proto/disagg.proto",
        package=PACKAGE,
        syntax="proto3",
    )
    for message_name, fields in SEED_MESSAGES.items():
        message = file.message_type.add(name=message_name)
        message.field.extend(field_proto(field) for field in fields)
    return file


def independent_classes() -> dict[str, Any]:
    """Message name -> message class, from a private pool holding ``independent_file()``."""
    pool = descriptor_pool.DescriptorPool()
    pool.Add(independent_file())
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))
        for name in SEED_MESSAGES
    }
