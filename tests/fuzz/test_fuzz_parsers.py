"""Property-based tests of the parsers that read untrusted input: the client body checks,
the ``x-prefiller-host-port`` parser, allowlist entries and decisions, and the downward-API
label parser.

Proves, for arbitrary input (random bytes and text, and structured inputs built to reach the
interesting branches: control keys with every JSON type, duplicated keys, host:port shapes
made of the characters that matter): each parser returns a value or raises its own documented
error, never anything else, and what it accepts satisfies its contract. Does not prove the
parsers accept everything the engines accept (the golden tests cover the real shapes).
"""

from __future__ import annotations

import ipaddress
import json
import string
from typing import Any

from fuzz_builders import FUZZ
from hypothesis import given
from hypothesis import strategies as st
from protocol_builders import HANDOFF_FIELDS, parse_client_body

from sidecar.config.podinfo import PodInfoError, parse_podinfo_text
from sidecar.errors import InvalidRequest
from sidecar.protocol.context import PrefillTarget, Route
from sidecar.protocol.request import CONTROL_KEYS
from sidecar.targets.allowlist import Allowlist, parse_entry
from sidecar.targets.selector import parse_host_port, parse_target_header

JSON_SCALARS = (
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
)
JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=20,
)
KEYS = st.sampled_from(sorted(CONTROL_KEYS | {"prompt", "messages", "model"})) | st.text(
    max_size=10)
BODIES = st.dictionaries(KEYS, JSON, max_size=8)
ROUTES = st.sampled_from(list(Route))


def _check_body(raw: bytes, route: Route, trusted: bool) -> None:
    try:
        parsed = parse_client_body(raw, route, trusted_router=trusted)
    except InvalidRequest as error:
        assert error.http_status == 400 and error.message
        return
    assert isinstance(parsed.body, dict)
    assert isinstance(parsed.stream, bool)
    if not trusted:
        assert not set(HANDOFF_FIELDS) & set(parsed.body)


@FUZZ
@given(st.binary(max_size=512), ROUTES, st.booleans())
def test_client_body_from_any_bytes(raw: bytes, route: Route, trusted: bool) -> None:
    _check_body(raw, route, trusted)


@FUZZ
@given(BODIES, ROUTES, st.booleans())
def test_client_body_from_json_objects(body: dict[str, Any], route: Route,
                                       trusted: bool) -> None:
    _check_body(json.dumps(body).encode(), route, trusted)


@FUZZ
@given(BODIES, st.sampled_from(sorted(CONTROL_KEYS)), JSON, JSON, ROUTES)
def test_client_body_with_duplicated_keys(body: dict[str, Any], key: str, first: Any,
                                          second: Any, route: Route) -> None:
    # A duplicated key can only be written by hand: json.dumps never repeats one.
    inner = json.dumps(body)[1:-1]
    pairs = [f"{json.dumps(key)}: {json.dumps(first)}", f"{json.dumps(key)}: {json.dumps(second)}"]
    raw = ("{" + ", ".join([*pairs, inner] if inner else pairs) + "}").encode()
    try:
        parse_client_body(raw, route, trusted_router=True)
    except InvalidRequest:
        return
    raise AssertionError(f"duplicated {key!r} was accepted")


HOST_CHARS = string.ascii_letters + string.digits + ".-:[]@/?#% \t\x00\x7f_*"
HEADERS = st.one_of(
    st.text(max_size=60),
    st.text(alphabet=HOST_CHARS, max_size=40),
    st.builds(lambda h, p: f"{h}:{p}", st.text(alphabet=HOST_CHARS, max_size=30),
              st.integers(min_value=-10, max_value=70000)),
    st.builds(lambda a, p: f"[{a}]:{p}", st.ip_addresses(v=6).map(str),
              st.integers(min_value=0, max_value=65536)),
)


def _valid_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return all(ch.isascii() and (ch.isalnum() or ch in ".-") for ch in host)
    return True


@FUZZ
@given(HEADERS)
def test_target_header_parser(value: str) -> None:
    try:
        target = parse_host_port(value)
    except InvalidRequest as error:
        assert error.http_status == 400
        return
    assert isinstance(target, PrefillTarget)
    assert 1 <= target.port <= 65535
    assert target.host and _valid_host(target.host), target
    # What was accepted reads back the same from its own rendering.
    assert parse_host_port(str(target)) == target


@FUZZ
@given(st.lists(HEADERS, max_size=4))
def test_target_header_lists(values: list[str]) -> None:
    try:
        targets = parse_target_header(values)
    except InvalidRequest:
        return
    assert 1 <= len(targets) <= 16


ENTRY_CHARS = string.ascii_lowercase + string.digits + ".-:/[]*"
ADDRESSES = st.ip_addresses().map(lambda a: ipaddress.ip_address(str(a)))


@FUZZ
@given(st.one_of(st.text(max_size=40), st.text(alphabet=ENTRY_CHARS, max_size=30)),
       st.text(alphabet=string.ascii_lowercase + ".", max_size=20),
       st.lists(ADDRESSES, max_size=3), st.integers(min_value=1, max_value=65535))
def test_allowlist_entries_and_decisions(entry: str, host: str, addresses: list[Any],
                                         port: int) -> None:
    try:
        parsed = parse_entry(entry)
    except ValueError:
        return
    allowlist = Allowlist([parsed])
    decision = allowlist.allows(host, addresses, port)
    assert isinstance(decision, bool)
    if parsed.port is not None and parsed.port != port:
        assert not decision  # an entry never opens a port it does not name
    assert not Allowlist().allows(host, addresses, port)


LABEL_LINES = st.one_of(
    st.text(max_size=200),
    st.lists(
        st.builds(lambda k, v: f"{k}={v}", st.text(alphabet=string.printable, max_size=12),
                  st.text(alphabet='"\\abfnrtvxuU0123456789aef' + string.ascii_letters,
                          max_size=16).map(lambda v: f'"{v}"')),
        max_size=5,
    ).map("\n".join),
)


@FUZZ
@given(LABEL_LINES)
def test_label_parser(text: str) -> None:
    try:
        labels = parse_podinfo_text(text, "labels")
    except PodInfoError as error:
        assert "labels line" in str(error)
        return
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())
