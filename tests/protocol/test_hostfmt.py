"""Proves the URL host helper: IPv6 literals bracketed (idempotently), others unchanged."""

from __future__ import annotations

import pytest

from sidecar.protocol.context import http_url, is_ipv6_literal, url_host


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("10.0.0.1", "10.0.0.1"),
        ("prefill.svc.cluster.local", "prefill.svc.cluster.local"),
        ("::1", "[::1]"),
        ("fd00:10:244::8", "[fd00:10:244::8]"),
        ("fe80::1%eth0", "[fe80::1%eth0]"),
        ("[::1]", "[::1]"),
        ("localhost", "localhost"),
    ],
)
def test_url_host(host: str, expected: str) -> None:
    assert url_host(host) == expected


def test_http_url() -> None:
    assert http_url("fd00::8", 8998) == "http://[fd00::8]:8998"
    assert http_url("10.0.0.8", 8998) == "http://10.0.0.8:8998"


def test_is_ipv6_literal() -> None:
    assert is_ipv6_literal("::") is True
    assert is_ipv6_literal("1.2.3.4") is False
    assert is_ipv6_literal("[::1]") is False
