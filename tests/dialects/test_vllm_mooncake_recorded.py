"""Proves the vLLM Mooncake hand-off against answers recorded from the real engine (vLLM
0.32.0 on CPU, tests/fixtures/vllm/0.32.0/mooncake_*.json, captured by
tests/real_vllm/record_fixtures.py --only mooncake):

- ``engine_id_from_query`` reads the prefill engine's id from the recorded bootstrap
  ``GET /query`` answer (the shape vLLM 0.32 really serves: keyed by data-parallel rank);
- with the recording's transfer id and engine id, the sidecar's prefill and decode bodies
  for the recorded client request are exactly the recorded requests that moved the KV;
- the stub engine's ``/query`` answer has the real answer's structure;
- with a DP 2 prefill (one bootstrap server, one entry per rank) the engine id of each rank is
  read by rank, and for a request on rank 1 the dialect sends exactly the recorded header and
  bodies (rank 1's engine id, read from the recorded answer) that moved the KV; the stub's
  two-rank ``/query`` has the recorded structure; with one server per rank each answer has
  one entry, "0".

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
from sidecar.errors import InvalidHandoff
from sidecar.protocol.context import HandoffContext, PrefillTarget, Route
from sidecar.tools.stubs import StubConfig, run_stub

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "0.32.0"
QUERY = FIXTURES / "mooncake_query.json"
EXCHANGES = sorted(
    p for p in FIXTURES.glob("mooncake_*.json") if p != QUERY and "_dp2" not in p.stem
)
# Recorded with a DP 2 prefill by tests/real_vllm/probe_data_parallel.py.
QUERY_DP2 = FIXTURES / "mooncake_query_dp2.json"
EXCHANGE_DP2_RANK1 = FIXTURES / "mooncake_completion_dp2_rank1.json"
QUERY_DP2_EXTERNAL = FIXTURES / "mooncake_query_dp2_external_lb.json"
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


def test_each_rank_engine_id_is_read_from_the_recorded_dp2_query_answer() -> None:
    recorded = _load(QUERY_DP2)
    answer, base = recorded["query_response"], recorded["prefill_engine_id"]
    assert sorted(answer) == ["0", "1"]
    # vLLM suffixes the configured id with the rank (v1/engine/core.py 1417-1425).
    assert [engine_id_from_query(answer, dp_rank) for dp_rank in (0, 1)] == [
        f"{base}_dp0", f"{base}_dp1"]
    with pytest.raises(InvalidHandoff, match="no data-parallel rank 2"):
        engine_id_from_query(answer, 2)


class RecordedQuery:
    """An ``EngineLookup`` answering with a recorded ``/query`` body."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.urls: list[str] = []

    async def get(self, url: str, *, max_bytes: int) -> tuple[int, bytes]:
        self.urls.append(url)
        return 200, json.dumps(self.answer).encode()


async def test_the_rank1_exchange_is_what_the_dialect_sends_for_rank1() -> None:
    recorded, query = _load(EXCHANGE_DP2_RANK1), _load(QUERY_DP2)
    assert recorded["decode_equals_connectorless_decode"] is True
    bootstrap = urlsplit(query["bootstrap_addr"])
    assert bootstrap.hostname is not None and bootstrap.port is not None
    lookup = RecordedQuery(query["query_response"])
    dialect = make_dialect(dialect_class("vllm", "mooncake"), lookup=lookup,
                           prefill_ranks=2, mooncake_bootstrap_port=bootstrap.port)
    dialect.new_transfer_id = lambda: recorded["transfer_id"]
    ctx = dialect.begin(HandoffContext(
        route=ROUTES[recorded["endpoint"]], request_id="rec",
        prefill=PrefillTarget(bootstrap.hostname, 8000), advertise_host=bootstrap.hostname,
        prefill_rank=1,
    ))
    # The dialect reads rank 1's entry of the recorded answer: what vLLM's decode accepted.
    ctx = await dialect.look_up(ctx)
    assert lookup.urls == [query["bootstrap_addr"] + "/query"]
    client = recorded["client_request"]
    assert dict(dialect.prefill_headers(ctx)) == recorded["prefill_headers"]
    assert dialect.prefill_body(client, ctx) == recorded["prefill_request"]
    handoff = dialect.handoff(recorded["prefill_response"], ctx)
    assert dialect.decode_body(client, handoff) == recorded["decode_request"]
    params = recorded["decode_request"]["kv_transfer_params"]
    assert params["remote_engine_id"] == engine_id_from_query(query["query_response"], 1)


def test_one_bootstrap_server_per_rank_answers_one_entry_keyed_zero() -> None:
    recorded = _load(QUERY_DP2_EXTERNAL)
    base = recorded["prefill_engine_id"]
    for rank, server in sorted(recorded["per_rank_server"].items()):
        answer = server["query_response"]
        assert list(answer) == ["0"]  # the local rank of a one-rank server
        assert engine_id_from_query(answer) == f"{base}_dp{rank.removeprefix('r')}"


def _structure(value: Any) -> Any:
    """Keys and leaf types of a JSON value (what a parser of it depends on)."""
    if isinstance(value, dict):
        return {key: _structure(item) for key, item in value.items()}
    return type(value).__name__


async def test_stub_dp2_query_answer_has_the_recorded_structure() -> None:
    real = _load(QUERY_DP2)["query_response"]
    config = StubConfig(engine="vllm", role="prefill", kv_connector="mooncake",
                        data_parallel_size=2)
    async with run_stub(config) as stub, aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{stub.bootstrap_port}/query") as response:
            answer = await response.json()
    assert _structure(answer) == _structure(real)
    assert [engine_id_from_query(answer, rank) for rank in (0, 1)] == [
        f"{stub.engine_id}_dp0", f"{stub.engine_id}_dp1"]


async def test_stub_query_answer_has_the_recorded_structure() -> None:
    real = _load(QUERY)["query_response"]
    config = StubConfig(engine="vllm", role="prefill", kv_connector="mooncake")
    async with run_stub(config) as stub, aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{stub.bootstrap_port}/query") as response:
            answer = await response.json()
    assert _structure(answer) == _structure(real)
