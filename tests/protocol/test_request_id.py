"""Proves the request-id rule: a sane client id is kept, anything else replaced by a fresh
version-4 UUID written as 32 hex digits (what ``uuid.uuid4().hex`` writes). Does not prove
randomness beyond distinct draws."""

from __future__ import annotations

import uuid

import pytest

from sidecar.protocol.request import logged_request_id, new_request_id, request_id_or_new


def test_a_new_id_is_a_version_4_uuid_in_hex() -> None:
    for _ in range(200):
        text = new_request_id()
        parsed = uuid.UUID(hex=text)
        assert parsed.hex == text and len(text) == 32
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122


def test_new_ids_differ() -> None:
    assert len({new_request_id() for _ in range(1000)}) == 1000


@pytest.mark.parametrize("given", ["abc-123", "a" * 200, "req:7@host/x+y=z"])
def test_a_sane_client_id_is_kept(given: str) -> None:
    assert request_id_or_new(given) == given


@pytest.mark.parametrize("given", [None, "", "a" * 201, "bad id", "x\r\nInjected: 1",
                                   "trailing-line-feed\n", "a" * 200 + "\n"])
def test_anything_else_gets_a_fresh_id(given: str | None) -> None:
    fresh = request_id_or_new(given)
    assert fresh != given and uuid.UUID(hex=fresh).version == 4


def test_a_log_line_names_only_a_sane_id() -> None:
    assert logged_request_id("abc-1") == "abc-1"
    assert logged_request_id("abc-1\n") == "-"
    assert logged_request_id(None) == "-"
