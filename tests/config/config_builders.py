"""Builders shared by the configuration tests: Go-style quoting, podinfo dirs, parsed flags."""

from __future__ import annotations

import argparse
import unicodedata
from collections.abc import Mapping, Sequence
from pathlib import Path

from sidecar.config.loader import LoadedSettings, add_settings_arguments, load_settings

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "podinfo"

_GO_ESCAPES = {"\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t",
               "\v": "\\v", "\\": "\\\\", '"': '\\"'}


def _go_printable(ch: str) -> bool:
    # Go's unicode.IsPrint: letters, marks, numbers, punctuation, symbols, and ASCII space.
    return ch == " " or unicodedata.category(ch)[0] in "LMNPS"


def go_quote(value: str) -> str:
    """What Go's ``%q`` (strconv.Quote) writes for ``value``: the kubelet's label format."""
    out = ['"']
    for ch in value:
        code = ord(ch)
        if ch in _GO_ESCAPES:
            out.append(_GO_ESCAPES[ch])
        elif _go_printable(ch):
            out.append(ch)
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\x{code:02x}")
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


def format_map(values: Mapping[str, str]) -> str:
    """Kubernetes ``fieldpath.FormatMap``: sorted ``key=%q`` lines, no trailing newline."""
    return "\n".join(f"{key}={go_quote(values[key])}" for key in sorted(values))


def write_podinfo(
    directory: Path,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
) -> Path:
    """A downward-API directory; a mapping left None leaves its file out."""
    directory.mkdir(parents=True, exist_ok=True)
    if labels is not None:
        (directory / "labels").write_text(format_map(labels), encoding="utf-8")
    if annotations is not None:
        (directory / "annotations").write_text(format_map(annotations), encoding="utf-8")
    return directory


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="disagg-sidecar")
    add_settings_arguments(p)
    return p


def args(*argv: str) -> argparse.Namespace:
    return parser().parse_args(list(argv))


def load(
    argv: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    *,
    podinfo: Path | None = None,
) -> LoadedSettings:
    """Load from flags and env; ``podinfo`` adds ``--podinfo-dir`` unless argv names one."""
    full = list(argv)
    if podinfo is not None:
        full += ["--podinfo-dir", str(podinfo)]
    return load_settings(args(*full), dict(env or {}))
