"""The recorded vLLM fixtures (tests/fixtures/vllm/<version>/) are what they claim to be.

Proves: every file names the vLLM version of its folder and of the harness; its prefill and
decode requests are exactly what the reference builders (client.py) make from the recorded
client request and prefill reply (NIXL) or from the recorded transfer id and bootstrap
``/query`` answer (Mooncake); the hand-off has the keys decode needs; every recorded request
body passes vLLM's own request models (run in the engine venv). Needs the engine venv, not
running engines.

Does not prove the fixtures are current: re-record them when the vLLM pin changes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from real_vllm.client import decode_body, mooncake_decode_body, mooncake_prefill_body, prefill_body
from real_vllm.engine_schema import RequestKind, VllmSchema
from real_vllm.harness import VLLM_VERSION

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / VLLM_VERSION
FILES = sorted(FIXTURES.glob("nixl_*.json"))
MOONCAKE_QUERY = FIXTURES / "mooncake_query.json"
# The single-rank exchanges; the data-parallel recordings (``*_dp2*``) pair with their own
# /query answers (tests/dialects/test_vllm_mooncake_recorded.py).
MOONCAKE_FILES = sorted(p for p in FIXTURES.glob("mooncake_*.json")
                        if p != MOONCAKE_QUERY and "_dp2" not in p.stem)
DECODE_NEEDS = {
    "do_remote_prefill",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
}


def _load(path: Path) -> dict[str, Any]:
    record: dict[str, Any] = json.loads(path.read_text())
    return record


def _kind(record: dict[str, Any]) -> RequestKind:
    return "chat" if record["endpoint"] == "/v1/chat/completions" else "completion"


def test_fixtures_exist() -> None:
    assert len(FILES) >= 5


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_fixture_is_consistent(path: Path) -> None:
    record = _load(path)
    assert record["vllm_version"] == VLLM_VERSION == path.parent.name
    assert record["prefill_request"] == prefill_body(record["client_request"])
    assert record["decode_request"] == decode_body(
        record["client_request"], record["prefill_response"]
    )
    params = record["prefill_response"]["kv_transfer_params"]
    assert params.keys() >= DECODE_NEEDS
    assert params["do_remote_prefill"] is True
    assert record["prefill_response"]["system_fingerprint"].startswith(f"vllm-{VLLM_VERSION}")
    if record["client_request"].get("stream"):
        assert record["decode_response_sse"].rstrip().endswith("data: [DONE]")
    else:
        assert record["decode_response"]["choices"][0]["finish_reason"] == "length"


def test_fixture_requests_pass_vllm_request_models(vllm_schema: VllmSchema) -> None:
    items: list[tuple[RequestKind, dict[str, Any]]] = []
    for path in FILES:
        record = _load(path)
        for key in ("client_request", "prefill_request", "decode_request"):
            items.append((_kind(record), record[key]))
    assert vllm_schema.validate_many(items) == [None] * len(items)


@pytest.mark.parametrize("path", MOONCAKE_FILES, ids=[p.stem for p in MOONCAKE_FILES])
def test_mooncake_fixture_is_consistent(path: Path) -> None:
    record, query = _load(path), _load(MOONCAKE_QUERY)
    assert record["vllm_version"] == query["vllm_version"] == VLLM_VERSION == path.parent.name
    engine_id = query["query_response"]["0"]["engine_id"]
    assert engine_id == query["prefill_engine_id"]
    assert record["prefill_request"] == mooncake_prefill_body(
        record["client_request"], record["transfer_id"]
    )
    assert record["decode_request"] == mooncake_decode_body(
        record["client_request"], record["transfer_id"], query["bootstrap_addr"], engine_id
    )
    if record["client_request"].get("stream"):
        assert record["decode_response_sse"].rstrip().endswith("data: [DONE]")
    else:
        assert record["decode_response"]["choices"][0]["finish_reason"] == "length"


def test_mooncake_fixture_requests_pass_vllm_request_models(vllm_schema: VllmSchema) -> None:
    assert MOONCAKE_FILES
    items: list[tuple[RequestKind, dict[str, Any]]] = []
    for path in MOONCAKE_FILES:
        record = _load(path)
        for key in ("client_request", "prefill_request", "decode_request"):
            items.append((_kind(record), record[key]))
    assert vllm_schema.validate_many(items) == [None] * len(items)
