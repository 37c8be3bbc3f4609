"""The pod's own labels and annotations, read from a Kubernetes downward-API volume.

    <podinfo-dir>/labels:       model.aibrix.ai/engine="vllm"      one key="value" per line,
    <podinfo-dir>/annotations:  note="two\\nlines \\u00e9"          the value in Go's %q

Deliberate limits: read once at start (the loader's job), never watched; a missing directory
or file means no labels or annotations; a malformed line is an error naming the file and line.

The kubelet's file format, escape by escape: docs/extending/design-notes.md#downward-api-files
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

LABELS_FILE = "labels"
ANNOTATIONS_FILE = "annotations"

_SIMPLE_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
                   "\\": "\\", '"': '"'}
_HEX_WIDTH = {"x": 2, "u": 4, "U": 8}
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
_OCT_DIGITS = frozenset("01234567")


class PodInfoError(ValueError):
    """A downward-API file that cannot be read or parsed; the message names file and line."""


def _empty() -> Mapping[str, str]:
    return MappingProxyType({})


@dataclass(frozen=True)
class PodInfo:
    """The pod's labels and annotations (read-only mappings)."""

    labels: Mapping[str, str] = field(default_factory=_empty)
    annotations: Mapping[str, str] = field(default_factory=_empty)


def unquote_go(quoted: str) -> str:
    """The string a Go double-quoted literal (as ``strconv.Quote`` writes it) stands for;
    ValueError on a missing quote, an unescaped quote inside, or a bad escape."""
    if len(quoted) < 2 or quoted[0] != '"' or quoted[-1] != '"':
        raise ValueError("value is not a double-quoted string")
    body = quoted[1:-1]
    # Bytes, not str: "\xNN" stands for one byte of the string, which may be half a rune.
    out = bytearray()
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == '"':
            raise ValueError(f"unescaped quote at column {i + 2}")
        if ch != "\\":
            out += ch.encode()
            i += 1
            continue
        if i + 1 >= len(body):
            raise ValueError("backslash at end of value")
        esc = body[i + 1]
        if esc in _SIMPLE_ESCAPES:
            out += _SIMPLE_ESCAPES[esc].encode()
            i += 2
        elif esc in _HEX_WIDTH:
            width = _HEX_WIDTH[esc]
            digits = body[i + 2 : i + 2 + width]
            if len(digits) != width or not set(digits) <= _HEX_DIGITS:
                raise ValueError(f"bad \\{esc} escape at column {i + 2}: needs {width} hex digits")
            code = int(digits, 16)
            if esc == "x":
                out.append(code)
            elif code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                raise ValueError(f"\\{esc}{digits} at column {i + 2} is not a valid rune")
            else:
                out += chr(code).encode()
            i += 2 + width
        elif esc in _OCT_DIGITS:
            digits = body[i + 1 : i + 4]
            if len(digits) != 3 or not set(digits) <= _OCT_DIGITS or int(digits, 8) > 255:
                raise ValueError(f"bad octal escape at column {i + 2}")
            out.append(int(digits, 8))
            i += 4
        else:
            raise ValueError(f"unknown escape \\{esc} at column {i + 2}")
    # Bytes Go quoted as \xNN because they were not UTF-8 stay undecodable: mark, don't fail.
    return out.decode("utf-8", "replace")


def parse_podinfo_text(text: str, source: str) -> dict[str, str]:
    """Parse one downward-API file's text; ``source`` names it in error messages."""
    result: dict[str, str] = {}
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        key, sep, quoted = line.partition("=")
        if not sep or not key or key != key.strip():
            raise PodInfoError(f"{source} line {number}: expected key=\"value\", got {line!r}")
        if key in result:
            raise PodInfoError(f"{source} line {number}: duplicate key {key!r}")
        try:
            result[key] = unquote_go(quoted)
        except ValueError as exc:
            raise PodInfoError(f"{source} line {number} ({key}): {exc}") from None
    return result


def _read_file(path: Path) -> dict[str, str]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise PodInfoError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PodInfoError(f"{path}: not UTF-8 at byte {exc.start}") from None
    return parse_podinfo_text(text, str(path))


def read_podinfo(directory: str | Path) -> PodInfo:
    """Read ``labels`` and ``annotations`` under ``directory``; missing files are empty."""
    base = Path(directory)
    return PodInfo(
        labels=MappingProxyType(_read_file(base / LABELS_FILE)),
        annotations=MappingProxyType(_read_file(base / ANNOTATIONS_FILE)))
