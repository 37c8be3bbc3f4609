"""The configuration reference, generated from the Settings definition so it cannot drift.

    Settings fields + descriptions + loader naming + groups  ->  Markdown, a section per group

``python -m sidecar.config.docs`` prints it; ``python -m sidecar.config.docs --write`` refreshes
the block between the markers of ``REFERENCE_PAGE`` (docs/operating/configuration.md), and a
test fails when the two differ or a field has no description.

Layout: one section per group of ``serve --help`` (``sidecar.config.groups``), one heading per
setting (its name, so ``configuration.md#prefill_allowlist`` links to it), then a line naming
its flag, variable, pod source and default, then its description. A line and a paragraph wrap
at any width; the six-column table this replaced was cut off at laptop width (issue #36), and
tests/docs/test_docs_layout.py checks the rendered page for anything that would be.
Deliberate limits: Markdown only; ``--help`` renders the same descriptions through argparse.
"""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Any

from sidecar.config.groups import grouped
from sidecar.config.loader import (
    LIST_FIELDS,
    REPEATABLE_FIELDS,
    env_for,
    field_names,
    flag_for,
    is_bool_field,
)
from sidecar.config.settings import EXTRA_ENV, POD_SOURCES, Settings

START_MARKER = "<!-- config-reference:start -->"
END_MARKER = "<!-- config-reference:end -->"
#: The docs page holding the generated reference, relative to the repository root.
REFERENCE_PAGE = Path("docs/operating/configuration.md")

PRECEDENCE = (
    "Precedence, highest first: command-line flag > environment variable `DISAGG_*` > the pod's "
    "label or annotation (downward-API files `labels` and `annotations` under `--podinfo-dir`) "
    "> default. Lists are comma-separated in the environment; booleans read "
    "true/false/1/0/yes/no; an empty variable counts as unset. "
    "`disagg-sidecar config [flags]` prints the resolved values and their sources as JSON."
)


class UndocumentedSetting(ValueError):
    """A Settings field without a description."""


def _default_text(value: Any) -> str:
    if value is None:
        return "(unset)"
    if isinstance(value, tuple):
        return "(empty)" if not value else ", ".join(f"`{item}`" for item in value)
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, Enum):
        return f"`{value.value}`"
    return f"`{value}`"


def _flag_text(name: str) -> str:
    flag = flag_for(name)
    if is_bool_field(name):
        return f"`{flag}` / `--no-{flag[2:]}`"
    if name in REPEATABLE_FIELDS:
        return f"`{flag}` (repeatable, comma-separated)"
    if name in LIST_FIELDS:
        return f"`{flag}` (comma-separated)"
    return f"`{flag}`"


def _env_text(name: str) -> str:
    names = [env_for(name), *EXTRA_ENV.get(name, ())]
    return ", then ".join(f"`{env}`" for env in names)


def _pod_text(name: str) -> str | None:
    pod = POD_SOURCES.get(name)
    if pod is None:
        return None
    key = Settings.model_fields[pod.key_field].default
    return f"{pod.kind} `{key}` (key: `{flag_for(pod.key_field)}`)"


def _prose(text: str) -> str:
    """A description as Markdown that shows it as written: one line, ``*`` not emphasis
    (``HOST:*, CIDR:*``), ``<`` not a tag (``<id>_dp<rank>``)."""
    return " ".join(text.split()).replace("*", "\\*").replace("<", "&lt;")


def _setting_markdown(name: str) -> list[str]:
    """One setting: its heading, where it is set and its default on one line, its
    description."""
    info = Settings.model_fields[name]
    if not info.description:
        raise UndocumentedSetting(f"setting {name!r} has no description")
    default = info.get_default(call_default_factory=True)
    where = [f"flag {_flag_text(name)}", f"env {_env_text(name)}"]
    pod = _pod_text(name)
    if pod is not None:
        where.append(pod)
    where.append(f"default {_default_text(default)}")
    return [f"### `{name}`", "", " · ".join(where), "", _prose(info.description), ""]


def configuration_reference_markdown() -> str:
    """The reference: a precedence line, then a section per group with one entry per
    setting."""
    lines = [PRECEDENCE, ""]
    for group, names in grouped(field_names()):
        heading = group.description[0].upper() + group.description[1:]
        lines += [f"## {heading}", ""]
        for name in names:
            lines += _setting_markdown(name)
    return "\n".join(lines).rstrip("\n") + "\n"


def write_into(page: Path) -> None:
    """Replace the block between the markers of ``page`` with the generated reference."""
    text = page.read_text(encoding="utf-8")
    start = text.index(START_MARKER) + len(START_MARKER)
    end = text.index(END_MARKER)
    generated = "\n" + configuration_reference_markdown()
    page.write_text(text[:start] + generated + text[end:], encoding="utf-8")


def main() -> None:
    """Print the reference; ``--write [PAGE]`` refreshes that page's block instead (default:
    ``REFERENCE_PAGE``, from the repository root)."""
    if len(sys.argv) in (2, 3) and sys.argv[1] == "--write":
        write_into(Path(sys.argv[2]) if len(sys.argv) == 3 else REFERENCE_PAGE)
        return
    print(configuration_reference_markdown(), end="")


if __name__ == "__main__":
    main()
