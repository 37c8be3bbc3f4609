"""JSON encoding for bodies the sidecar must parse or build (orjson: several times faster).

Integers from -2**63 to 2**64-1 stay exact (TensorRT-LLM ids above 2**53 must survive a round
trip). orjson parses an integer beyond that range as a float (2**64 comes back out as
``1.8446744073709552e+19``), so a document from outside the sidecar (a client's body, a
router's hand-off) is read with ``loads_exact``, which refuses such an integer naming where
it was (``IntegerOutOfRange``); engines' answers, which never hold one, are read with
``loads``. orjson parses documents nested up to 1,024 levels but writes only ``MAX_DEPTH``
(254): a parsed value that goes back out (every body the sidecar forwards, a hand-off it
merges) must be checked with ``too_deep`` first.
"""

from __future__ import annotations

import json
from typing import Any, Final

import orjson

JSONDecodeError = orjson.JSONDecodeError

#: The integers every parser on the way (orjson, the engines' int64 and uint64 fields) keeps.
INT_MIN: Final = -(2**63)
INT_MAX: Final = 2**64 - 1
#: An integer outside [INT_MIN, INT_MAX] has 19 digits or more (no leading zeros in JSON).
#: A text's bytes through ``_DIGITS_AS_ZERO`` (each ASCII digit "0", any other byte "x") hold
#: ``_LONG_RUN`` where it has such a run: a translation and a search, both in C, took 0.74 us
#: on a 785-byte body where the regular expression ``[0-9]{19}`` took 6.7 us (its matcher
#: tries every position).
_DIGITS_AS_ZERO: Final = bytes(0x30 if 0x30 <= byte <= 0x39 else 0x78 for byte in range(256))
_LONG_RUN: Final = b"0" * 19


class IntegerOutOfRange(JSONDecodeError):
    """A document holds an integer beyond 64 bits; ``path`` says where (``seed``,
    ``logit_bias.50256``, ``messages[0].n``): a ``JSONDecodeError`` to any caller that does
    not ask."""

    def __init__(self, path: str, doc: str) -> None:
        super().__init__(f"integer beyond 64 bits at {path}", doc, 0)
        self.path = path


class _Wide:
    """An integer literal outside the 64-bit range, kept as text (never made an int: a
    4,300-digit literal would exceed Python's own conversion limit)."""


def _wide_or_int(text: str) -> int | _Wide:
    if len(text) < 19:
        return int(text)
    value = int(text) if len(text) <= 21 else None
    return value if value is not None and INT_MIN <= value <= INT_MAX else _Wide()


def _wide_path(value: Any) -> str | None:
    """Where the first ``_Wide`` in ``value`` is, as ``a.b[2].c`` (None: nowhere)."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, _Wide):
            return path or "the document"
        if isinstance(item, dict):
            stack.extend((child, f"{path}.{key}" if path else str(key))
                         for key, child in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{index}]")
                         for index, child in reversed(list(enumerate(item))))
    return None


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """Parse JSON text; raises ``JSONDecodeError`` on malformed input."""
    return orjson.loads(data)


def loads_exact(data: bytes) -> Any:
    """``loads``, refusing an integer beyond 64 bits (``IntegerOutOfRange``) instead of
    turning it into a float. A document without a run of 19 digits pays one scan for it."""
    value = orjson.loads(data)
    if data.translate(_DIGITS_AS_ZERO).find(_LONG_RUN) < 0 or too_deep(value, data):
        return value  # (too deep: refused by the caller's depth check, whatever it holds)
    # Rare: a long digit run (a big integer, or digits inside a string). Read it again with
    # the standard parser, whose integer hook sees every literal as written.
    text = data.decode("utf-8")
    path = _wide_path(json.loads(text, parse_int=_wide_or_int))
    if path is not None:
        raise IntegerOutOfRange(path, text)
    return value


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


def with_fields(raw: bytes, fields: dict[str, Any]) -> bytes:
    """``raw`` (a JSON object's text, none of ``fields``' keys in it) with ``fields`` added at
    its top level, written before its first key: the rest stays byte for byte as it was, so a
    body that travels as it came pays one copy, never a parse and a write."""
    if not fields:
        return raw
    start = raw.find(b"{")
    if start < 0:
        raise ValueError("not a JSON object")
    added = orjson.dumps(fields)[1:-1]
    rest = raw[start + 1:]
    separator = b"" if rest.lstrip().startswith(b"}") else b","
    return raw[:start + 1] + added + separator + rest
