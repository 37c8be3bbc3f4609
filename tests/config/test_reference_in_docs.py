"""Proves the docs' configuration reference is exactly the generated one, and that every
``serve`` flag is documented.

docs/operating/configuration.md carries the output of ``python -m sidecar.config.docs``
between the lines ``<!-- config-reference:start -->`` and ``<!-- config-reference:end -->``;
this test fails when a setting changes without the page following. To refresh the block:
``python -m sidecar.config.docs --write``. Every flag ``disagg-sidecar serve`` takes must
appear somewhere under docs/ (the generated reference names every setting's; a flag added
outside the settings needs a page of its own).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from sidecar.__main__ import build_parser
from sidecar.config.docs import (
    END_MARKER,
    REFERENCE_PAGE,
    START_MARKER,
    configuration_reference_markdown,
)

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / REFERENCE_PAGE


def extract_block(text: str) -> str | None:
    """The text between the markers; None when there are no markers."""
    if START_MARKER not in text and END_MARKER not in text:
        return None
    assert text.count(START_MARKER) == 1, f"the page needs exactly one {START_MARKER}"
    assert text.count(END_MARKER) == 1, f"the page needs exactly one {END_MARKER}"
    start = text.index(START_MARKER) + len(START_MARKER)
    end = text.index(END_MARKER)
    assert start <= end, "the config-reference markers are out of order"
    return text[start:end]


def test_extract_block() -> None:
    generated = configuration_reference_markdown()
    text = f"# Title\n\n{START_MARKER}\n{generated}\n{END_MARKER}\nafter\n"
    block = extract_block(text)
    assert block is not None and block.strip() == generated.strip()
    assert extract_block("# no markers\n") is None
    with pytest.raises(AssertionError):
        extract_block(f"{END_MARKER}\n{START_MARKER}\n")


def test_docs_reference_matches_generated() -> None:
    block = extract_block(PAGE.read_text(encoding="utf-8"))
    assert block is not None, f"{REFERENCE_PAGE} lost its config-reference markers"
    assert block.strip() == configuration_reference_markdown().strip(), (
        f"{REFERENCE_PAGE}'s configuration reference is stale: replace the block between the "
        "markers by running `python -m sidecar.config.docs --write`"
    )


def _serve_flags() -> list[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = action.choices["serve"]
    return [flag for a in serve._actions if a.option_strings
            and not isinstance(a, argparse._HelpAction) for flag in a.option_strings
            if flag.startswith("--")]


def documented_text() -> str:
    return "\n".join(page.read_text(encoding="utf-8")
                     for page in sorted((ROOT / "docs").rglob("*.md")))


def test_every_serve_flag_appears_in_the_docs() -> None:
    docs = documented_text()
    flags = _serve_flags()
    assert len(flags) > 50
    missing = [flag for flag in flags if f"`{flag}" not in docs]
    assert not missing, f"serve flags no page under docs/ names: {missing}"


def test_a_flag_missing_from_the_docs_is_seen() -> None:
    assert "`--no-such-flag" not in documented_text()
