"""Proves ``parse_client_body``: what it accepts and every refusal, on both routes.

Refusals (InvalidRequest, HTTP 400, with a message naming the problem): malformed JSON, a
non-object body, wrong types of the fields the sidecar reads, client-supplied hand-off fields
(allowed for a trusted router), duplicated top-level control keys (found via the raw bytes,
confirmed at the top level only), mixed prompt batches. The body is returned as parsed; n > 1
and batched prompts are described (``batch``, ``n``) for the fan-out.
"""

from __future__ import annotations

from typing import Any

import pytest
from protocol_builders import HANDOFF_FIELDS, OPENAI_ROUTE_LIST, parse_client_body

from sidecar import jsonutil
from sidecar.errors import InvalidRequest
from sidecar.protocol.context import Route
from sidecar.protocol.request import ClientRequest

COMPLETION: dict[str, Any] = {"model": "m", "prompt": "hi", "max_tokens": 8}
CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _raw(body: object) -> bytes:
    return jsonutil.dumps(body)


def _refused(raw: bytes, route: Route = Route.COMPLETIONS, match: str = "") -> None:
    with pytest.raises(InvalidRequest, match=match) as info:
        parse_client_body(raw, route)
    assert info.value.http_status == 400


def test_accepts_completions() -> None:
    body = {**COMPLETION, "stream": True, "n": 1, "max_completion_tokens": None}
    request = parse_client_body(_raw(body), Route.COMPLETIONS)
    assert request == ClientRequest(route=Route.COMPLETIONS, body=body, stream=True)


def test_accepts_chat_and_defaults_stream_false() -> None:
    request = parse_client_body(_raw(CHAT), Route.CHAT)
    assert request.stream is False
    assert request.body == CHAT
    assert parse_client_body(_raw({**CHAT, "stream": None}), Route.CHAT).stream is False


@pytest.mark.parametrize(
    ("prompt", "batch"),
    [("text", None), ([1, 2, 3], None), (["one prompt"], None), ([[1, 2, 3]], None), ("", None),
     (["a", "b"], ["a", "b"]), ([[1], [2, 3]], [[1], [2, 3]])],
)
def test_accepted_prompt_forms(prompt: object, batch: object) -> None:
    request = parse_client_body(_raw({**COMPLETION, "prompt": prompt}), Route.COMPLETIONS)
    assert request.body["prompt"] == prompt  # the client's prompt, as sent
    assert request.batch == batch  # a batch only when several prompts are given
    assert request.route is Route.COMPLETIONS and request.n == 1


def test_unknown_fields_pass_through() -> None:
    body = {**CHAT, "tools": [{"type": "function"}], "vendor_x": {"a": [1]}}
    assert parse_client_body(_raw(body), Route.CHAT).body == body


@pytest.mark.parametrize("raw", [b"", b"{", b"{'a': 1}", b"nope", b'{"a": 1,}'])
def test_malformed_json(raw: bytes) -> None:
    _refused(raw, match="not valid JSON")


@pytest.mark.parametrize("raw", [b"[]", b"1", b'"s"', b"null", b"true"])
def test_not_an_object(raw: bytes) -> None:
    _refused(raw, match="must be a JSON object")


@pytest.mark.parametrize("value", ["yes", 1, 0, [], {}])
def test_stream_must_be_bool(value: object) -> None:
    _refused(_raw({**COMPLETION, "stream": value}), match="'stream' must be a boolean")


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens", "min_tokens"])
@pytest.mark.parametrize("value", ["8", 8.0, True, [8], {}])
def test_token_limits_must_be_int_or_null(key: str, value: object) -> None:
    _refused(_raw({**COMPLETION, key: value}), match=f"'{key}' must be an integer or null")


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens", "min_tokens"])
def test_token_limits_accept_null(key: str) -> None:
    parse_client_body(_raw({**CHAT, key: None}), Route.CHAT)


@pytest.mark.parametrize("value", ["2", 1.0, True])
def test_n_must_be_int(value: object) -> None:
    _refused(_raw({**COMPLETION, "n": value}), match="'n' must be an integer")


@pytest.mark.parametrize("route", OPENAI_ROUTE_LIST)
def test_n_above_one_is_a_fanout(route: Route) -> None:
    base = COMPLETION if route is Route.COMPLETIONS else CHAT
    client = parse_client_body(_raw({**base, "n": 3}), route)
    assert (client.n, client.batch, client.sub_requests) == (3, None, 3)


@pytest.mark.parametrize(
    ("prompt", "batch"),
    [(["a", "b"], ["a", "b"]), ([[1, 2], [3, 4]], [[1, 2], [3, 4]]), (["a"], None),
     ([[1, 2]], None), ([1, 2], None), ("a", None)],
)
def test_batched_prompts_are_a_fanout(prompt: object, batch: object) -> None:
    client = parse_client_body(_raw({**COMPLETION, "prompt": prompt, "n": 2}),
                               Route.COMPLETIONS)
    assert client.batch == batch
    assert client.sub_requests == 2 * (len(batch) if isinstance(batch, list) else 1)


@pytest.mark.parametrize("prompt", [["a", [1]], [[1], "a"], [[1, 2], []]])
def test_mixed_batches_refused(prompt: object) -> None:
    _refused(_raw({**COMPLETION, "prompt": prompt}), match="'prompt' must")


@pytest.mark.parametrize(
    "prompt", [None, 5, {"text": "x"}, [], [1, "a"], [True, 2], [[]], [["a"]], [1.5]]
)
def test_prompt_wrong_type(prompt: object) -> None:
    _refused(_raw({**COMPLETION, "prompt": prompt}), match="'prompt' must")


def test_prompt_required_for_completions() -> None:
    _refused(_raw({"model": "m"}), match="'prompt' is required")


@pytest.mark.parametrize("messages", [None, [], "hi", {"role": "user"}, ["hi"], [{}, 3]])
def test_messages_must_be_non_empty_list_of_objects(messages: object) -> None:
    body = {"model": "m"} if messages is None else {"model": "m", "messages": messages}
    _refused(_raw(body), Route.CHAT, match="'messages' must be a non-empty array of objects")


@pytest.mark.parametrize("key", HANDOFF_FIELDS)
@pytest.mark.parametrize("route", OPENAI_ROUTE_LIST)
def test_client_handoff_fields_refused(key: str, route: Route) -> None:
    base = COMPLETION if route is Route.COMPLETIONS else CHAT
    _refused(_raw({**base, key: {"x": 1}}), route, match=f"hand-off field.*{key}")


@pytest.mark.parametrize("key", HANDOFF_FIELDS)
def test_handoff_fields_allowed_for_trusted_router(key: str) -> None:
    body = {**COMPLETION, key: 1}
    request = parse_client_body(_raw(body), Route.COMPLETIONS, trusted_router=True)
    assert request.body[key] == 1


def test_handoff_field_set_to_null_is_still_refused() -> None:
    _refused(_raw({**COMPLETION, "kv_transfer_params": None}), match="kv_transfer_params")


@pytest.mark.parametrize(
    "key",
    [
        "max_tokens",
        "max_completion_tokens",
        "min_tokens",
        "min_completion_tokens",
        "stream",
        "stream_options",
        "n",
    ],
)
def test_duplicated_control_keys_refused(key: str) -> None:
    raw = b'{"model": "m", "prompt": "hi", "%s": 1, "%s": 2}' % (key.encode(), key.encode())
    if key == "stream":
        raw = raw.replace(b"1", b"true").replace(b"2", b"false")
    if key == "stream_options":
        raw = raw.replace(b"1", b"{}").replace(b"2", b"null")
    _refused(raw, match=f"duplicated top-level key.*{key}")


@pytest.mark.parametrize("key", HANDOFF_FIELDS)
def test_duplicated_handoff_keys_refused_even_for_trusted_router(key: str) -> None:
    raw = b'{"model": "m", "prompt": "hi", "%s": 1, "%s": 2}' % (key.encode(), key.encode())
    with pytest.raises(InvalidRequest, match="duplicated"):
        parse_client_body(raw, Route.COMPLETIONS, trusted_router=True)


def test_duplicate_of_an_uncontrolled_key_is_left_alone() -> None:
    raw = b'{"model": "a", "model": "m", "prompt": "hi"}'
    assert parse_client_body(raw, Route.COMPLETIONS).body["model"] == "m"


def test_nested_repeats_of_control_names_are_not_duplicates() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": 'say "max_tokens" and "n"'}],
        "max_tokens": 5,
        "n": 1,
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {"properties": {"max_tokens": {}, "n": {}, "stream": {}}},
                },
            }
        ],
        "stream": False,
        "response_format": {"max_tokens": 3, "stream": True},
    }
    assert parse_client_body(_raw(body), Route.CHAT).body == body


def test_duplicate_inside_nested_object_is_not_top_level() -> None:
    raw = (
        b'{"model": "m", "prompt": "hi", "max_tokens": 4, '
        b'"x": {"max_tokens": 1, "max_tokens": 2}}'
    )
    assert parse_client_body(raw, Route.COMPLETIONS).body["max_tokens"] == 4


def test_large_ids_and_unicode_survive() -> None:
    body = {**COMPLETION, "prompt": [2**62 + 1, 5], "user": "Zoë ✓"}
    assert parse_client_body(_raw(body), Route.COMPLETIONS).body == body


def test_error_messages_never_echo_the_prompt() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_client_body(_raw({"model": "m", "prompt": {"secret": "s3cr3t"}}), Route.COMPLETIONS)
    assert "s3cr3t" not in info.value.message


def test_slow_duplicate_check_runs_only_on_repeated_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sidecar.protocol.request as request_module

    calls: list[bytes] = []
    real_loads = request_module.json.loads

    def counting_loads(raw: bytes, **kwargs: Any) -> Any:
        calls.append(raw)
        return real_loads(raw, **kwargs)

    monkeypatch.setattr(request_module.json, "loads", counting_loads)
    parse_client_body(_raw({**COMPLETION, "stream": True, "n": 1}), Route.COMPLETIONS)
    assert calls == []
    parse_client_body(_raw({**COMPLETION, "x": {"max_tokens": 1}}), Route.COMPLETIONS)
    assert len(calls) == 1


@pytest.mark.parametrize("depth", [1, 2, 254, 255, 1024])
def test_nesting_depth_is_measured_as_orjson_writes_it(depth: int) -> None:
    value: object = {}
    for level in range(depth - 1):
        value = [value] if level % 2 else {"k": value}
    raw = jsonutil.dumps(value) if depth <= jsonutil.MAX_DEPTH else None
    assert jsonutil.too_deep(value, raw) is (depth > jsonutil.MAX_DEPTH)
    if depth <= jsonutil.MAX_DEPTH:
        jsonutil.dumps(value)  # what is not too deep is written
