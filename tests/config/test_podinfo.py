"""Proves the downward-API reader reads what the kubelet writes.

The kubelet writes ``key=%q`` lines (Go's strconv.Quote; kubernetes pkg/fieldpath FormatMap).
Covered: the sample fixtures, every escape Go writes (quotes, backslashes, newlines, tabs, \\x,
\\u, \\U, printable Unicode as is), bytes that are not UTF-8, a round trip against a Go-quoting
oracle, missing files, and malformed lines naming file and line. Not covered: the kubelet's
atomic symlink swaps (we read once at start).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from config_builders import FIXTURES, format_map, go_quote, write_podinfo
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from sidecar.config.podinfo import PodInfoError, parse_podinfo_text, read_podinfo, unquote_go


def test_reads_aibrix_fixture() -> None:
    pod = read_podinfo(FIXTURES / "aibrix-decode")
    assert pod.labels["model.aibrix.ai/engine"] == "vllm"
    assert pod.labels["model.aibrix.ai/kv-connector-type"] == "NIXL"
    assert pod.labels["role-name"] == "decode"
    assert pod.annotations["model.aibrix.ai/sglang-bootstrap-port"] == "9001"
    assert len(pod.labels) == 5


def test_escaped_fixture() -> None:
    pod = read_podinfo(FIXTURES / "escaped")
    assert pod.annotations["description"] == 'say "hi" to C:\\pods\nsecond line\tend'
    assert pod.annotations["note"] == "café 😀 \x01 \u200b \U000f0000 \ufffd"
    assert pod.annotations["plain"] == ""


@pytest.mark.parametrize(
    ("quoted", "value"),
    [
        (r'"a\"b"', 'a"b'),
        (r'"back\\slash"', "back\\slash"),
        (r'"l1\nl2\r\n"', "l1\nl2\r\n"),
        (r'"\a\b\f\t\v"', "\a\b\f\t\v"),
        (r'"\x00\x7f"', "\x00\x7f"),
        (r'"\u00e9\u200B"', "é\u200b"),
        (r'"\U0001F600"', "😀"),
        (r'"\xc3\xa9"', "é"),  # \x escapes are bytes: two of them can form one rune
        (r'"\101"', "A"),  # octal, which Go's Unquote also reads
        ('"日本語 = ok"', "日本語 = ok"),
        ('""', ""),
    ],
)
def test_unquote_escapes(quoted: str, value: str) -> None:
    assert unquote_go(quoted) == value


@pytest.mark.parametrize(
    "quoted",
    [
        "plain",
        '"open',
        'close"',
        '"a"b"',
        '"bad \\q escape"',
        '"short \\x4"',
        '"short \\u12"',
        '"surrogate \\ud800"',
        '"too big \\U00110000"',
        '"trailing \\"',
        '"octal \\400"',
    ],
)
def test_unquote_refuses(quoted: str) -> None:
    with pytest.raises(ValueError):
        unquote_go(quoted)


@hypothesis_settings(derandomize=True, max_examples=200)
@given(st.dictionaries(st.from_regex(r"[a-z0-9./-]{1,20}", fullmatch=True), st.text()))
def test_round_trip_against_go_quote(values: dict[str, str]) -> None:
    assert parse_podinfo_text(format_map(values), "labels") == values


def test_go_quote_oracle_matches_known_outputs() -> None:
    # Strings as Go's fmt.Sprintf("%q", s) writes them.
    assert go_quote('a"b\\c\n') == r'"a\"b\\c\n"'
    assert go_quote("\x01é\u200b") == r'"\x01é\u200b"'


def test_missing_files_are_empty(tmp_path: Path) -> None:
    pod = read_podinfo(tmp_path)
    assert dict(pod.labels) == {}
    assert dict(pod.annotations) == {}
    write_podinfo(tmp_path, labels={"a": "1"})
    pod = read_podinfo(tmp_path)
    assert dict(pod.labels) == {"a": "1"}
    assert dict(pod.annotations) == {}


def test_empty_file_and_blank_lines(tmp_path: Path) -> None:
    (tmp_path / "labels").write_text("", encoding="utf-8")
    (tmp_path / "annotations").write_text('a="1"\n\nb="2"\n', encoding="utf-8")
    pod = read_podinfo(tmp_path)
    assert dict(pod.labels) == {}
    assert dict(pod.annotations) == {"a": "1", "b": "2"}


def test_malformed_line_names_file_and_line() -> None:
    with pytest.raises(PodInfoError) as info:
        read_podinfo(FIXTURES / "malformed")
    message = str(info.value)
    assert str(FIXTURES / "malformed" / "labels") in message
    assert "line 2" in message
    assert "model.aibrix.ai/port" in message


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ('a="1"\nno equals sign', 2),
        ('="value"', 1),
        (' a="1"', 1),
        ('a="1"\na="2"', 2),
        ('a="1"\nb="bad \\z"', 2),
    ],
)
def test_malformed_lines(text: str, line: int) -> None:
    with pytest.raises(PodInfoError, match=f"annotations line {line}"):
        parse_podinfo_text(text, "annotations")


def test_file_not_utf8(tmp_path: Path) -> None:
    (tmp_path / "labels").write_bytes(b'a="\xff"')
    with pytest.raises(PodInfoError, match="not UTF-8"):
        read_podinfo(tmp_path)


def test_unreadable_path_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "labels").mkdir()
    with pytest.raises(PodInfoError, match="cannot read"):
        read_podinfo(tmp_path)
