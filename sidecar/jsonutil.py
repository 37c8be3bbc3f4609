"""JSON encoding for bodies the sidecar must parse or build (orjson: several times faster).

Integers stay exact (TensorRT-LLM ids above 2**53 must survive a round trip); orjson refuses
integers beyond 64 bits, which no engine sends.
"""

from __future__ import annotations

from typing import Any

import orjson

JSONDecodeError = orjson.JSONDecodeError


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """Parse JSON text; raises ``JSONDecodeError`` on malformed input."""
    return orjson.loads(data)


def dumps(obj: Any) -> bytes:
    """Serialize to compact UTF-8 JSON bytes."""
    return orjson.dumps(obj)


def type_name(value: object) -> str:
    """The JSON name of a parsed value's type, for messages (never a Python class name)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    return "object"
