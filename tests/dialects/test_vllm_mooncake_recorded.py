"""Proves the vLLM Mooncake hand-off against answers recorded from the real engine (vLLM
0.32.0 on CPU, tests/fixtures/vllm/0.32.0/mooncake_*.json, captured by
tests/real_vllm/record_fixtures.py --only mooncake):

- ``engine_id_from_query`` reads the prefill engine's id from the recorded bootstrap
  ``GET /query`` answer (the shape vLLM 0.32 really serves: keyed by data-parallel rank);
- with the recording's transfer id and engine id, the sidecar's prefill and decode bodies
  for the recorded client request are exactly the recorded requests that moved the KV;
- the stub engine's ``/query`` answer has the real answer's structure.

Does not run an engine; tests/real_vllm/test_mooncake.py re-proves the flow live.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
from protocol_builders import make_dialect

from sidecar.dialects import dialect_class
from sidecar.dialects.vllm_mooncake import MooncakeState, engine_id_from_query
from sidecar.protocol.context import HandoffContext, PrefillTarget, Route
from sidecar.tools.stubs import StubConfig, run_stub

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "0.32.0"
QUERY = FIXTURES / "mooncake_query.json"
EXCHANGES = sorted(p for p in FIXTURES.glob("mooncake_*.json") if p != QUERY)
ROUTES = {"/v1/completions": Route.COMPLETIONS, "/v1/chat/completions": Route.CHAT}


def _load(path: Path) -> dict[str, Any]:
    recorded: dict[str, Any] = json.loads(path.read_text())
    assert recorded["vllm_version"] == "0.32.0"
    assert recorded["connector"] == "MooncakeConnector"
    return recorded


def test_fixtures_are_present() -> None:
    assert QUERY.is_file()
    assert len(EXCHANGES) >= 2


def test_engine_id_is_read_from_the_recorded_query_answer() -> None:
    recorded = _load(QUERY)
    assert engine_id_from_query(recorded["query_response"]) == recorded["prefill_engine_id"]


@pytest.mark.parametrize("path", EXCHANGES, ids=[p.stem for p in EXCHANGES])
def test_sidecar_bodies_equal_the_recorded_ones(path: Path) -> None:
    recorded = _load(path)
    engine_id = engine_id_from_query(_load(QUERY)["query_response"])
    client = recorded["client_request"]
    bootstrap = urlsplit(recorded["decode_request"]["kv_transfer_params"]
                         ["remote_bootstrap_addr"])
    assert bootstrap.hostname is not None and bootstrap.port is not None
    handler = make_dialect(dialect_class("vllm", "mooncake"),
                           mooncake_bootstrap_port=bootstrap.port)
    ctx = HandoffContext(
        route=ROUTES[recorded["endpoint"]], request_id="rec",
        prefill=PrefillTarget(bootstrap.hostname, 8000), advertise_host=bootstrap.hostname,
    ).with_state(MooncakeState(recorded["transfer_id"], engine_id))

    assert handler.prefill_body(client, ctx) == recorded["prefill_request"]
    # The push flow reads nothing from the prefill's answer (vLLM returns no params).
    assert recorded["prefill_response"]["kv_transfer_params"] is None
    handoff = handler.handoff(recorded["prefill_response"], ctx)
    assert handler.decode_body(client, handoff) == recorded["decode_request"]


def _structure(value: Any) -> Any:
    """Keys and leaf types of a JSON value (what a parser of it depends on)."""
    if isinstance(value, dict):
        return {key: _structure(item) for key, item in value.items()}
    return type(value).__name__


async def test_stub_query_answer_has_the_recorded_structure() -> None:
    real = _load(QUERY)["query_response"]
    config = StubConfig(engine="vllm", role="prefill", kv_connector="mooncake")
    async with run_stub(config) as stub, aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{stub.bootstrap_port}/query") as response:
            answer = await response.json()
    assert _structure(answer) == _structure(real)
