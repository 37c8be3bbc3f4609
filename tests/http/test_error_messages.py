"""Proves that a failed leg is reported in words, naming the target that failed: the client's
message never names a Python class, names a router-named prefill target (the router's own)
as ``host:port``, and the log names every failed target, static-pool members included.

Does not prove every wording (the error table in docs/operating/errors.md lists the codes, which are
the
contract); only that each class of failure says what happened and where.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
from pd_builders import pd_pair

#: What a Python class name looks like in a message (CamelCase ending in Error/Exception, or
#: the http1 client's own classes).
_CLASS_NAME = re.compile(r"\b(?:[A-Z][a-z]+){2,}(?:Error|Exception)\b|\bUpstream[A-Z]\w+")


def _message(text: str) -> str:
    message = json.loads(text)["error"]["message"]
    assert not _CLASS_NAME.search(message), message
    return str(message)


async def test_refused_router_target_is_named_in_the_message_and_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    async with pd_pair("vllm", "shfs", prefill_allowlist=("127.0.0.1:*",)) as pair:
        status, _, text = await pair.send(headers={"x-prefiller-host-port": "127.0.0.1:1"})
    assert status == 502, text
    message = _message(text)
    assert "refused the connection" in message and "127.0.0.1:1" in message, message
    assert any("127.0.0.1:1" in record.getMessage() for record in caplog.records)


async def test_pool_target_is_named_in_the_log_only(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    async with pd_pair("vllm", "shfs", prefill_urls=("http://127.0.0.1:1",)) as pair:
        status, _, text = await pair.send(with_target=False)
    assert status == 502, text
    message = _message(text)
    assert "refused the connection" in message and "127.0.0.1:1" not in message, message
    assert any("127.0.0.1:1" in record.getMessage() for record in caplog.records)


async def test_prefill_cut_after_the_request_says_so_in_words(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    async with pd_pair("vllm", "shfs") as pair:
        pair.prefill.faults.add("drop", path="/v1/completions", times=1)
        status, _, text = await pair.send()
    assert status == 502, text
    message = _message(text)
    assert "closed the connection" in message and pair.target in message, message
    assert any(pair.target in record.getMessage() for record in caplog.records)


async def test_prefill_garbage_says_so_in_words() -> None:
    async with pd_pair("vllm", "shfs") as pair:
        pair.prefill.faults.add("malformed", path="/v1/completions", times=1)
        status, _, text = await pair.send()
    assert status == 502, text
    assert "malformed JSON" in _message(text)


async def test_decode_cut_before_its_head_says_so_in_words() -> None:
    async with pd_pair("vllm", "shfs") as pair:
        pair.decode.faults.add("drop", path="/v1/completions", times=1)
        status, _, text = await pair.send()  # JSON: the stub closes before any byte
    assert status == 502, text
    assert "closed the connection" in _message(text)
