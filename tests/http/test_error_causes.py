"""Proves each misconfiguration the newcomer met is answered with its cause and its fix
(issue #29), over real sockets with stub engines:

- a Mooncake bootstrap port the prefill engine does not serve: the lookup's message names the
  address it asked and the setting that chose its port (the flag and the engine's variable);
  for a static-pool target the client is not told the address, the log is;
- an SGLang bootstrap port the prefill engine does not serve: the decode's failure says to
  check the bootstrap port and names the one sent;
- a decode sidecar set to NixlConnector (``shfs``) in front of MooncakeConnector engines: the
  message names the connector it expected and how to check the engines';
- the same answers without the hint where the engines agree (the hint is not noise).
"""

from __future__ import annotations

import json
import logging
import socket

import pytest
from pd_builders import pd_pair


def _free_port() -> int:
    with socket.socket() as sock:  # bound, then closed: nothing listens there
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _error(text: str) -> dict[str, str]:
    error: dict[str, str] = json.loads(text)["error"]
    return error


async def test_mooncake_lookup_names_the_address_and_the_port_setting() -> None:
    port = _free_port()
    async with pd_pair("vllm", "mooncake", mooncake_bootstrap_port=port) as pair:
        status, _, text = await pair.send()
    assert status == 502, text
    message = _error(text)["message"]
    assert f"http://127.0.0.1:{port}/query" in message, message
    assert "--mooncake-bootstrap-port" in message and "VLLM_MOONCAKE_BOOTSTRAP_PORT" in message
    assert f"is {port}" in message


async def test_mooncake_pool_target_keeps_its_address_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    port = _free_port()
    # A static pool member (the lookup asks its bootstrap port before any prefill leg).
    async with pd_pair("vllm", "mooncake", mooncake_bootstrap_port=port,
                       prefill_urls=("http://127.0.0.1:1",)) as pair:
        status, _, text = await pair.send(with_target=False)
    assert status == 502, text
    message = _error(text)["message"]
    assert "127.0.0.1" not in message and "in the sidecar's log" in message, message
    assert "--mooncake-bootstrap-port" in message
    assert any(f"127.0.0.1:{port}/query" in r.getMessage() for r in caplog.records)


async def test_sglang_rendezvous_failure_names_the_bootstrap_port_sent() -> None:
    port = _free_port()
    async with pd_pair("sglang", sglang_bootstrap_port=port) as pair:
        status, _, text = await pair.send()
    assert status == 502, text
    error = _error(text)
    assert error["code"] == "decode_failed", error
    assert "check the bootstrap port" in error["message"] and f"{port} sent" in error["message"]
    assert "--disaggregation-bootstrap-port" in error["message"]


async def test_sglang_decode_failure_without_a_rendezvous_fault_still_says_what_happened(
) -> None:
    async with pd_pair("sglang") as pair:
        pair.decode.faults.add("status", status=500, path="/v1/completions", times=1)
        status, _, text = await pair.send()
    assert status == 502, text
    assert "decode engine answered HTTP 500" in _error(text)["message"]


async def test_a_connector_mismatch_names_the_expected_connector() -> None:
    async with pd_pair("vllm", "mooncake", kv_connector="shfs") as pair:
        status, _, text = await pair.send()
    assert status == 502, text
    error = _error(text)
    assert error["code"] == "invalid_handoff", error
    message = error["message"]
    assert "no kv_transfer_params" in message and "NixlConnector" in message, message
    assert "kv connector 'shfs'" in message and "--kv-transfer-config" in message
    assert "--kv-connector" in message


async def test_agreeing_engines_answer() -> None:
    for engine, connector in (("sglang", "shfs"), ("vllm", "mooncake"), ("vllm", "shfs")):
        async with pd_pair(engine, connector) as pair:
            status, _, text = await pair.send()
        assert status == 200, (engine, connector, text)
