"""Proves the prefill allowlist parses every entry form and decides targets fail-closed.

Covered: host names (case, trailing dot), bare IPs as /32 and /128, CIDRs, IPv6 in brackets,
``*`` and fixed ports, every-address coverage (a name that resolves partly outside is refused:
DNS rebinding), IPv4-mapped IPv6 addresses, the empty allowlist, and malformed entries.
Not covered: resolving names (the caller's job).
"""

from __future__ import annotations

from ipaddress import ip_address

import pytest

from sidecar.targets.allowlist import Allowlist, parse_entry


def allows(entries: list[str], host: str, addresses: list[str], port: int) -> bool:
    return Allowlist.parse(entries).allows(host, [ip_address(a) for a in addresses], port)


def test_hostname_entry_matches_host_string_case_insensitively() -> None:
    entries = ["Prefill-0.Prefill.NS.svc.cluster.local:8000"]
    assert allows(entries, "prefill-0.prefill.ns.svc.cluster.local", [], 8000)
    assert allows(entries, "PREFILL-0.prefill.ns.svc.cluster.local.", ["203.0.113.9"], 8000)
    assert not allows(entries, "prefill-0.prefill.ns.svc.cluster.local", [], 8001)
    assert not allows(entries, "prefill-1.prefill.ns.svc.cluster.local", [], 8000)


def test_hostname_any_port() -> None:
    assert allows(["prefill:*"], "prefill", [], 1)
    assert allows(["prefill:*"], "prefill", [], 65535)


def test_bare_ip_is_a_single_address() -> None:
    assert allows(["10.0.0.7:8000"], "10.0.0.7", ["10.0.0.7"], 8000)
    assert not allows(["10.0.0.7:8000"], "10.0.0.8", ["10.0.0.8"], 8000)
    assert not allows(["10.0.0.7:8000"], "10.0.0.7", ["10.0.0.7"], 8001)
    assert allows(["[fd00::7]:8000"], "fd00::7", ["fd00::7"], 8000)
    assert not allows(["[fd00::7]:8000"], "fd00::8", ["fd00::8"], 8000)


def test_cidr_entries() -> None:
    assert allows(["10.0.0.0/8:*"], "10.200.3.4", ["10.200.3.4"], 12345)
    assert not allows(["10.0.0.0/8:*"], "11.0.0.1", ["11.0.0.1"], 12345)
    assert allows(["[fd00::/8]:8000"], "x", ["fd12::1"], 8000)
    assert not allows(["[fd00::/8]:8000"], "x", ["fd12::1"], 9000)
    assert not allows(["[fd00::/8]:8000"], "x", ["fe80::1"], 8000)


def test_every_resolved_address_must_be_covered() -> None:
    # A name resolving to one listed and one unlisted address is refused (DNS rebinding).
    entries = ["10.0.0.0/24:8000"]
    assert allows(entries, "prefill", ["10.0.0.1", "10.0.0.2"], 8000)
    assert not allows(entries, "prefill", ["10.0.0.1", "169.254.169.254"], 8000)
    # Each address may be covered by a different entry, but each for this port.
    assert allows(["10.0.0.1:8000", "[fd00::/8]:*"], "p", ["10.0.0.1", "fd00::1"], 8000)
    assert not allows(["10.0.0.1:9000", "[fd00::/8]:*"], "p", ["10.0.0.1", "fd00::1"], 8000)


def test_ip_entries_need_addresses() -> None:
    assert not allows(["10.0.0.0/8:*"], "prefill", [], 8000)


def test_ipv4_mapped_ipv6_address_is_judged_as_ipv4() -> None:
    assert allows(["10.0.0.0/8:8000"], "p", ["::ffff:10.1.2.3"], 8000)
    assert not allows(["10.0.0.0/8:8000"], "p", ["::ffff:192.168.1.1"], 8000)


def test_ip_entry_does_not_match_other_family() -> None:
    assert not allows(["0.0.0.0/0:*"], "p", ["fd00::1"], 8000)
    assert allows(["[::/0]:*", "0.0.0.0/0:*"], "p", ["fd00::1", "10.0.0.1"], 8000)


def test_empty_allowlist_allows_nothing() -> None:
    empty = Allowlist.parse([])
    assert len(empty) == 0
    assert not empty.allows("localhost", [ip_address("127.0.0.1")], 8000)


def test_entry_fields() -> None:
    entry = parse_entry(" 10.0.0.0/8:8000 ")
    assert entry.network is not None and str(entry.network) == "10.0.0.0/8"
    assert entry.port == 8000 and entry.hostname is None
    entry = parse_entry("[fd00::1]:*")
    assert entry.network is not None and entry.network.prefixlen == 128 and entry.port is None
    assert parse_entry("Prefill.svc.:80").hostname == "prefill.svc"


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ("prefill", "expected HOST:PORT"),
        (":8000", "expected HOST:PORT"),
        ("prefill:", "port must be"),
        ("prefill:0", "port must be"),
        ("prefill:65536", "port must be"),
        ("prefill:80a", "port must be"),
        ("prefill:+80", "port must be"),
        ("*:8000", "wildcard"),
        ("*.svc:8000", "wildcard"),
        ("fd00::1:8000", "brackets"),
        ("[fd00::1]", "expected \\[IPv6\\]"),
        ("[fd00::1]8000", "expected \\[IPv6\\]"),
        ("[10.0.0.1]:80", "IPv6 only"),
        ("10.0.0.1/8:80", "host bits"),
        ("10.0.0.256:80", "does not appear"),
        ("10.0.0.0/33:80", "does not appear"),
        ("bad_host:80", "not a host name"),
        ("host.123:80", "not a valid IP"),
        ("-lead.svc:80", "not a host name"),
        ("prefill\n.svc:80", "control characters"),  # refused before a label is read
    ],
)
def test_malformed_entries_are_refused(entry: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as info:
        parse_entry(entry)
    assert repr(entry) in str(info.value)


#: Each malformed form and the words of its own message (issue #29: ``http://10.0.0.1:8000``
#: was told to write IPv6 in brackets).
FORMS = {
    "http://10.0.0.1:8000": "no scheme \\(http://\\).*e.g. 10.0.0.1:8000",
    "https://prefill.svc:8443": "no scheme \\(https://\\).*e.g. prefill.svc:8443",
    "user@10.0.0.1:8000": "no user info.*write 10.0.0.1:8000",
    "10.0.0.1:8000/v1": "no path \\(/v1\\): write 10.0.0.1:8000",
    "prefill.svc:8000?x=1": "no query",
    "prefill.svc:8000#top": "no fragment",
    "10.0.0.7": "names no port.*10.0.0.7:8000",
    "fd00::1": "names no port: write \\[fd00::1\\]:PORT",
    "fd00::1:8000": "write IPv6 in brackets, e.g. \\[fd00::1\\]:8000",
    "prefill.svc:8000:9000": "one colon, before the port",
    ":8000": "names no host",
    "prefill svc:8000": "spaces or control characters",
    "": "is empty",
}


@pytest.mark.parametrize(("entry", "why"), FORMS.items())
def test_each_malformed_form_gets_its_own_message(entry: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as info:
        parse_entry(entry)
    assert repr(entry) in str(info.value)


def test_the_messages_differ_by_form() -> None:
    messages = set()
    for entry in FORMS:
        with pytest.raises(ValueError) as info:
            parse_entry(entry)
        messages.add(str(info.value).replace(repr(entry), "ENTRY").split(":")[1][:12])
    assert len(messages) >= 10, messages
