"""Proves README.md's configuration reference is exactly the generated one.

README.md carries the output of ``python -m sidecar.config.docs`` between the lines
``<!-- config-reference:start -->`` and ``<!-- config-reference:end -->``; this test fails when
a setting changes without the README following. To refresh the block:
``python -m sidecar.config.docs --write README.md``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.config.docs import END_MARKER, START_MARKER, configuration_reference_markdown

README = Path(__file__).resolve().parents[2] / "README.md"


def extract_block(text: str) -> str | None:
    """The text between the markers; None when there are no markers."""
    if START_MARKER not in text and END_MARKER not in text:
        return None
    assert text.count(START_MARKER) == 1, f"README.md needs exactly one {START_MARKER}"
    assert text.count(END_MARKER) == 1, f"README.md needs exactly one {END_MARKER}"
    start = text.index(START_MARKER) + len(START_MARKER)
    end = text.index(END_MARKER)
    assert start <= end, "README.md's config-reference markers are out of order"
    return text[start:end]


def readme_block() -> str | None:
    if not README.is_file():
        return None
    return extract_block(README.read_text(encoding="utf-8"))


def test_extract_block() -> None:
    generated = configuration_reference_markdown()
    text = f"# Title\n\n{START_MARKER}\n{generated}\n{END_MARKER}\nafter\n"
    block = extract_block(text)
    assert block is not None and block.strip() == generated.strip()
    assert extract_block("# no markers\n") is None
    with pytest.raises(AssertionError):
        extract_block(f"{END_MARKER}\n{START_MARKER}\n")


def test_readme_reference_matches_generated() -> None:
    block = readme_block()
    assert block is not None, "README.md lost its <!-- config-reference:start/end --> markers"
    assert block.strip() == configuration_reference_markdown().strip(), (
        "README.md's configuration reference is stale: replace the block between the markers "
        "by running `python -m sidecar.config.docs --write README.md`"
    )
