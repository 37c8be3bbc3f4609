"""JSON encoding for bodies the sidecar must parse or build (orjson: several times faster).

Integers stay exact (TensorRT-LLM ids above 2**53 must survive a round trip); orjson refuses
integers beyond 64 bits, which no engine sends. orjson parses documents nested up to 1,024
levels but writes only ``MAX_DEPTH`` (254): a parsed value that goes back out (every body
the sidecar forwards, a hand-off it merges) must be checked with ``too_deep`` first.
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


#: The deepest nesting ``dumps`` writes (a top-level object or array is level 1).
MAX_DEPTH = 254


def too_deep(value: Any, raw: bytes | None = None, limit: int = MAX_DEPTH) -> bool:
    """Whether ``value`` nests objects and arrays more than ``limit`` levels deep.

    ``raw``: the text it was parsed from, when at hand. Each level opens with ``[`` or ``{``,
    so a text with no more than ``limit`` of them (counted in C) cannot be too deep and the
    walk is skipped: the common case costs two byte counts.
    """
    if raw is not None and raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, dict | list))
    return False


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
