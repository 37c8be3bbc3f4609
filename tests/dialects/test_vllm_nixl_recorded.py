"""Proves the vLLM NIXL hand-off against bodies recorded from the real engine (vLLM 0.32.0,
tests/fixtures/vllm/0.32.0, captured by tests/real_vllm/record_fixtures.py):

- the sidecar's prefill body for the recorded client request is the recorded prefill request;
- its decode body built from the recorded prefill response is the recorded decode request
  (every key of the engine's ``kv_transfer_params`` verbatim, ``remote_host`` rewritten);
- the stub engine's NIXL prefill answer has the real engine's shape (same keys, same types).

Does not run an engine; the real_vllm suite re-proves the flow live.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from protocol_builders import begin, make_dialect

from sidecar.dialects import dialect_class
from sidecar.protocol.context import HandoffContext, PrefillTarget, Route
from sidecar.tools.stubs import StubConfig, run_stub

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "0.32.0"
RECORDED = sorted(FIXTURES.glob("nixl_*.json"))
ROUTES = {"/v1/completions": Route.COMPLETIONS, "/v1/chat/completions": Route.CHAT}


def _load(path: Path) -> dict[str, Any]:
    recorded: dict[str, Any] = json.loads(path.read_text())
    assert recorded["vllm_version"] == "0.32.0"
    return recorded


def _ctx(route: Route, advertise_host: str) -> HandoffContext:
    return HandoffContext(route=route, request_id="rec", prefill=PrefillTarget("10.0.0.9", 8000),
                          advertise_host=advertise_host)


def test_fixtures_are_present() -> None:
    assert len(RECORDED) >= 4


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem for p in RECORDED])
def test_sidecar_bodies_equal_the_recorded_ones(path: Path) -> None:
    recorded = _load(path)
    handler = make_dialect(dialect_class("vllm", "shfs"))
    route = ROUTES[recorded["endpoint"]]
    ctx = begin(handler, _ctx(route, "127.0.0.1"))
    client = recorded["client_request"]

    assert handler.prefill_body(client, ctx) == recorded["prefill_request"]
    handoff = handler.handoff(recorded["prefill_response"], ctx)
    assert handler.decode_body(client, handoff) == recorded["decode_request"]


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem for p in RECORDED])
def test_recorded_params_pass_verbatim_but_the_host(path: Path) -> None:
    recorded = _load(path)
    handler = make_dialect(dialect_class("vllm", "shfs"))
    route = ROUTES[recorded["endpoint"]]
    params = recorded["prefill_response"]["kv_transfer_params"]
    handoff = handler.handoff(recorded["prefill_response"], _ctx(route, "10.1.2.3"))
    assert handoff["kv_transfer_params"] == {**params, "remote_host": "10.1.2.3"}
    assert list(handoff["kv_transfer_params"]) == list(params)  # key order kept


async def test_stub_prefill_answers_in_the_recorded_shape() -> None:
    recorded = _load(FIXTURES / "nixl_completion.json")
    real = recorded["prefill_response"]
    async with run_stub(StubConfig(engine="vllm", role="prefill", kv_connector="shfs")) as stub:
        body = {**recorded["prefill_request"], "model": "stub-model"}
        async with aiohttp.ClientSession() as session, session.post(
            stub.url + "/v1/completions", json=body
        ) as response:
            answer = await response.json()
    assert set(answer) == set(real)
    stub_params, real_params = answer["kv_transfer_params"], real["kv_transfer_params"]
    assert set(stub_params) == set(real_params)
    for key, value in real_params.items():
        if value is not None:
            assert type(stub_params[key]) is type(value), key
