"""Proves the vLLM dialects' bodies on every PD route against bodies recorded from the real
engine (vLLM 0.32.0, tests/fixtures/vllm/0.32.0/routes, captured by
tests/real_vllm/record_routes.py):

- NIXL: the sidecar's prefill body for the recorded client request (completions, chat,
  Responses, Messages, generate; JSON and streamed) is the recorded prefill request, and its
  decode body built from the recorded prefill answer is the recorded decode request;
- Mooncake: the same on Responses, Messages and generate, with the recorded transfer id;
- the engines and routes of the routes table of docs/driving/routes.md (``Dialect.route_support``).

Does not run an engine; tests/real_vllm/test_routes.py proves the flows live.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from protocol_builders import Ids, begin, make_dialect, make_ids

from sidecar.dialects import dialect_class
from sidecar.dialects.base import RouteSupport
from sidecar.protocol.context import HandoffContext, PrefillTarget, Route

ROUTES_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "0.32.0" / "routes"
NIXL = sorted(ROUTES_DIR.glob("*_nixl*.json"))
MOONCAKE = sorted(ROUTES_DIR.glob("*_mooncake*.json"))
BOOTSTRAP_PORT = 8998


def _load(path: Path) -> dict[str, Any]:
    recorded: dict[str, Any] = json.loads(path.read_text())
    assert recorded["vllm_version"] == "0.32.0"
    return recorded


def _ctx(route: Route) -> HandoffContext:
    return HandoffContext(route=route, request_id="rec", prefill=PrefillTarget("127.0.0.1", 8000),
                          advertise_host="127.0.0.1")


def test_every_route_was_recorded() -> None:
    routes = {_load(p)["endpoint"] for p in NIXL}
    assert routes == {route.value for route in Route}
    assert {_load(p)["endpoint"] for p in MOONCAKE} == {
        Route.RESPONSES.value, Route.MESSAGES.value, Route.GENERATE.value}


@pytest.mark.parametrize("path", NIXL, ids=[p.stem for p in NIXL])
def test_nixl_bodies_equal_the_recorded_ones(path: Path) -> None:
    recorded = _load(path)
    dialect = make_dialect(dialect_class("vllm", "shfs"))
    ctx = begin(dialect, _ctx(Route(recorded["endpoint"])))
    client = recorded["client_request"]
    assert dialect.prefill_body(client, ctx) == recorded["prefill_request"]
    handoff = dialect.handoff(recorded["prefill_response"], ctx)
    assert dialect.decode_body(client, handoff) == recorded["decode_request"]
    assert recorded["decode_equals_baseline"]


@pytest.mark.parametrize("path", MOONCAKE, ids=[p.stem for p in MOONCAKE])
def test_mooncake_bodies_equal_the_recorded_ones(path: Path) -> None:
    recorded = _load(path)
    dialect = make_dialect(dialect_class("vllm", "mooncake"),
                           mooncake_bootstrap_port=BOOTSTRAP_PORT)
    ids = Ids(snowflake=make_ids().snowflake, rooms=make_ids().rooms,
              transfer_id=lambda: recorded["transfer_id"])
    ctx = begin(dialect, _ctx(Route(recorded["endpoint"])), ids)
    decode_params = recorded["decode_request"]["kv_transfer_params"]
    ctx = ctx.with_state(type(ctx.state)(ctx.state.transfer_id, decode_params["remote_engine_id"]))
    client = recorded["client_request"]
    assert dialect.prefill_body(client, ctx) == recorded["prefill_request"]
    expected = dict(recorded["decode_request"])
    # The recording's bootstrap server listened on a free port; the dialect names its own.
    expected["kv_transfer_params"] = {**decode_params,
                                      "remote_bootstrap_addr": f"http://127.0.0.1:{BOOTSTRAP_PORT}"}
    assert dialect.decode_body(client, dialect.handoff(None, ctx)) == expected
    assert recorded["decode_equals_baseline"]


TABLE = {
    # engine, connector: completions, chat, responses, messages, generate (the table of
    # docs/driving/routes.md)
    ("vllm", "shfs"): "pd pd pd pd pd",
    ("vllm", "mooncake"): "pd pd pd pd pd",
    ("vllm", "nixl"): "pd pd local local local",
    ("sglang", None): "pd pd pd pd unserved",
    ("trtllm", None): "pd pd local local unserved",
    ("some-engine", None): "pd pd local local local",
}


@pytest.mark.parametrize(("engine", "connector"), list(TABLE), ids=lambda v: str(v))
def test_route_support_is_the_readme_table(engine: str, connector: str | None) -> None:
    cls = dialect_class(engine, connector)
    got = " ".join(cls.route_support(route).value for route in Route)
    assert got == TABLE[(engine, connector)]
    assert all(cls.route_support(route) is RouteSupport.PD
               for route in (Route.COMPLETIONS, Route.CHAT))
