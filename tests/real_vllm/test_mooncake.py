"""Real vLLM engines (CPU) with MooncakeConnector (push, TCP), behind the sidecar.

Proves, with this module's own Mooncake pair (prefill ``kv_producer``, decode ``kv_consumer``,
``mooncake_protocol: tcp``, loopback; vLLM's connector patched for CPU by setup_env.sh, see
mooncake_cpu_patch.py) and the session's baseline engine (no connector):
- the prefill's bootstrap ``GET /query`` answer is the shape the sidecar's agent parses, and
  ``engine_id_from_query`` reads from it the engine id the prefill engine was given;
- through the sidecar's HTTP front door (``--kv-connector mooncake``: concurrent legs, a new
  ``transfer_id`` each, the engine id from ``/query``) greedy output equals the baseline's for
  completions and chat, JSON and streamed, prompts of several KV blocks, several at once;
- the KV really moved: the decode engine's external-cache hits grow by the prompt's tokens;
- negative controls straight to the engines: a decode that names another prompt's
  ``transfer_id`` gets that prompt's KV (same length) and does not give the baseline's
  output; a decode naming an engine id the bootstrap server does not know fails cleanly
  (HTTP 500, vLLM's ``kv_load_failure_policy=fail``) and the engine keeps serving;
- the gRPC front door (Prefill on a prefill-role sidecar, Decode on a decode-role sidecar)
  streams the baseline's greedy token ids;
- the bodies the sidecar builds validate against vLLM's own request models.

Does not prove: RDMA or GPU memory (the CPU build and ``tcp`` only), data parallelism, or
the prefill's own transfer counters (vLLM 0.32 keeps Mooncake's stats out of /metrics).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from real_vllm.client import (
    EngineHTTPError,
    block_prompt,
    chat_body,
    completion_body,
    get_text,
    metric_value,
    mooncake_decode_body,
    mooncake_prefill_body,
    post_json,
    text_of,
)
from real_vllm.engine_schema import VllmSchema
from real_vllm.harness import (
    SERVED_MODEL_NAME,
    EngineEnv,
    EngineGroup,
    EngineSpec,
    mooncake_config,
)
from real_vllm.sidecar_process import Sidecar, sidecar_process, through
from real_vllm.stack import PdPair, RealVllm
from sidecar.config.settings import Settings
from sidecar.dialects import DialectSetup, dialect_class
from sidecar.dialects.vllm_mooncake import MooncakeState, engine_id_from_query
from sidecar.grpc_server.server import start_grpc_server
from sidecar.protocol.context import HandoffContext, PrefillTarget, Route
from sidecar.runtime import open_runtime
from sidecar.tools.route import route

ROUTES = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
PREFILL_ENGINE_ID = f"mooncake-prefill-{uuid.uuid4().hex[:8]}"
MAX_NEW_TOKENS = 12


@dataclass(frozen=True)
class MooncakePair(PdPair):
    """The stack's prefill/decode pair, with the prefill's Mooncake bootstrap port."""

    @property
    def bootstrap_port(self) -> int:
        port = self.prefill_engine.mooncake_bootstrap_port
        assert port is not None
        return port

    @property
    def bootstrap_addr(self) -> str:
        return f"http://127.0.0.1:{self.bootstrap_port}"


@pytest.fixture(scope="module")
def mooncake(engine_env: EngineEnv) -> Iterator[MooncakePair]:
    if not engine_env.mooncake_ready:
        pytest.fail(f"Mooncake is not set up in {engine_env.root}: run "
                    "bash tests/real_vllm/setup_env.sh", pytrace=False)
    with EngineGroup(engine_env) as group:
        engines = group.start([
            EngineSpec("mooncake-prefill", mooncake_config("kv_producer", PREFILL_ENGINE_ID),
                       cpu=0),
            EngineSpec("mooncake-decode", mooncake_config("kv_consumer"), cpu=1,
                       prefix_caching=False),
        ])
        yield MooncakePair("mooncake", engines["mooncake-prefill"], engines["mooncake-decode"])


@pytest.fixture(scope="module")
def mooncake_sidecar(mooncake: MooncakePair, tmp_path_factory: pytest.TempPathFactory
                     ) -> Iterator[Sidecar]:
    yield from sidecar_process(
        tmp_path_factory.mktemp("mooncake-sidecar"),
        "--engine", "vllm", "--kv-connector", "mooncake", "--engine-url", mooncake.decode,
        "--mooncake-bootstrap-port", str(mooncake.bootstrap_port),
    )


def _body(kind: str, tag: str, **extra: Any) -> dict[str, Any]:
    build = completion_body if kind == "completion" else chat_body
    return build(block_prompt(tag), **extra)


def _legs_at_once(pair: MooncakePair, prefill: dict[str, Any], decode: dict[str, Any]
                  ) -> dict[str, Any]:
    """Send both legs concurrently (the push flow); the decode reply once both ended."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        pre = pool.submit(post_json, pair.prefill + "/v1/completions", prefill, 120.0)
        dec = pool.submit(post_json, pair.decode + "/v1/completions", decode, 120.0)
        pre.result()
        return dec.result()


def test_bootstrap_query_is_what_the_agent_parses(mooncake: MooncakePair) -> None:
    answer = json.loads(get_text(mooncake.bootstrap_addr + "/query"))
    # vLLM 0.32: {dp_rank: {"engine_id": E, "worker_addr": {tp_rank: {pp_rank: addr}}}}
    assert list(answer) == ["0"]
    assert answer["0"]["engine_id"] == PREFILL_ENGINE_ID
    assert list(answer["0"]["worker_addr"]) == ["0"]
    assert engine_id_from_query(answer) == PREFILL_ENGINE_ID


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_mooncake_through_the_sidecar_equals_baseline(
    real_vllm: RealVllm, mooncake: MooncakePair, mooncake_sidecar: Sidecar, kind: str,
    stream: bool,
) -> None:
    body = _body(kind, f"mooncake-{kind}-{stream}")
    expected = text_of(post_json(real_vllm.baseline + ROUTES[kind], body))
    got = through(mooncake_sidecar, ROUTES[kind], {**body, "stream": stream},
                  mooncake.prefill_hostport)
    assert expected
    assert got == expected


def test_mooncake_through_the_sidecar_moves_the_kv(
    real_vllm: RealVllm, mooncake: MooncakePair, mooncake_sidecar: Sidecar
) -> None:
    body = _body("completion", "mooncake-kv-moves")
    prompt_tokens = post_json(real_vllm.baseline + ROUTES["completion"],
                              {**body, "max_tokens": 1})["usage"]["prompt_tokens"]
    assert prompt_tokens >= 3 * 32  # several KV blocks
    hits_before = metric_value(mooncake.decode, EXTERNAL_HITS)
    through(mooncake_sidecar, ROUTES["completion"], body, mooncake.prefill_hostport)
    # Without prefix caching on decode, only a push from the prefill gives external hits.
    assert metric_value(mooncake.decode, EXTERNAL_HITS) - hits_before >= prompt_tokens - 1


def test_several_mooncake_requests_at_once_each_equal_their_baseline(
    real_vllm: RealVllm, mooncake: MooncakePair, mooncake_sidecar: Sidecar
) -> None:
    bodies = [_body("completion", f"mooncake-parallel-{i}") for i in range(4)]
    expected = [text_of(post_json(real_vllm.baseline + ROUTES["completion"], b)) for b in bodies]
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        got = list(pool.map(
            lambda b: through(mooncake_sidecar, ROUTES["completion"], b,
                              mooncake.prefill_hostport),
            bodies,
        ))
    assert got == expected
    assert len(set(expected)) == len(expected)  # distinct prompts, distinct answers


def _same_length_prompts(real_vllm: RealVllm) -> tuple[list[int], list[int]]:
    ids = post_json(real_vllm.baseline + "/tokenize",
                    {"model": SERVED_MODEL_NAME, "prompt": block_prompt("mooncake-swap")})
    tokens = [int(t) for t in ids["tokens"]]
    assert len(tokens) >= 3 * 32
    return tokens, list(reversed(tokens))


def test_decode_given_another_prompts_transfer_id_does_not_give_the_baseline(
    real_vllm: RealVllm, mooncake: MooncakePair
) -> None:
    own, other = _same_length_prompts(real_vllm)
    body = completion_body(own)
    expected = text_of(post_json(real_vllm.baseline + "/v1/completions", body))
    engine_id = engine_id_from_query(json.loads(get_text(mooncake.bootstrap_addr + "/query")))

    # Control: the proper pairing gives the baseline, so the swap below is the only change.
    transfer = f"xfer-{uuid.uuid4().hex}"
    decode = _legs_at_once(
        mooncake, mooncake_prefill_body(body, transfer),
        mooncake_decode_body(body, transfer, mooncake.bootstrap_addr, engine_id))
    assert text_of(decode) == expected

    hits_before = metric_value(mooncake.decode, EXTERNAL_HITS)
    transfer = f"xfer-{uuid.uuid4().hex}"
    decode = _legs_at_once(
        mooncake, mooncake_prefill_body(completion_body(other), transfer),
        mooncake_decode_body(body, transfer, mooncake.bootstrap_addr, engine_id))
    assert text_of(decode) != expected
    assert metric_value(mooncake.decode, EXTERNAL_HITS) - hits_before >= len(own) - 1


def test_decode_naming_an_unknown_engine_fails_cleanly(
    real_vllm: RealVllm, mooncake: MooncakePair
) -> None:
    body = _body("completion", "mooncake-unknown-engine")
    wrong = mooncake_decode_body(body, f"xfer-{uuid.uuid4().hex}", mooncake.bootstrap_addr,
                                 "not-an-engine-of-this-bootstrap-server")
    with pytest.raises(EngineHTTPError) as failure:
        post_json(mooncake.decode + "/v1/completions", wrong)
    assert failure.value.status == 500
    log = mooncake.decode_engine.log_tail(200)
    assert "remote engine_id not-an-engine-of-this-bootstrap-server not found" in log
    # The engine keeps serving: a proper pair right after gives the baseline.
    engine_id = engine_id_from_query(json.loads(get_text(mooncake.bootstrap_addr + "/query")))
    transfer = f"xfer-{uuid.uuid4().hex}"
    decode = _legs_at_once(
        mooncake, mooncake_prefill_body(body, transfer),
        mooncake_decode_body(body, transfer, mooncake.bootstrap_addr, engine_id))
    assert text_of(decode) == text_of(post_json(real_vllm.baseline + "/v1/completions", body))


def _grpc_settings(engine_url: str, role: str, bootstrap_port: int) -> Settings:
    return Settings.model_validate({
        "engine": "vllm", "kv_connector": "mooncake", "engine_url": engine_url, "role": role,
        "host": "127.0.0.1", "port": 0, "grpc_port": 0, "advertise_host": "127.0.0.1",
        "mooncake_bootstrap_port": bootstrap_port, "log_level": "warning"})


async def test_grpc_pd_with_mooncake_gives_the_baseline_greedy_tokens(
    real_vllm: RealVllm, mooncake: MooncakePair
) -> None:
    tokens = post_json(real_vllm.baseline + "/tokenize",
                       {"model": SERVED_MODEL_NAME, "prompt": block_prompt("grpc-mooncake")})
    prompt_ids = [int(t) for t in tokens["tokens"]]
    baseline = post_json(real_vllm.baseline + "/v1/completions", {
        "model": SERVED_MODEL_NAME, "prompt": prompt_ids, "max_tokens": MAX_NEW_TOKENS,
        "temperature": 0, "return_token_ids": True,
    })["choices"][0]
    hits_before = metric_value(mooncake.decode, EXTERNAL_HITS)

    async with (
        open_runtime(_grpc_settings(mooncake.prefill, "prefill", mooncake.bootstrap_port)
                     ) as prefill_rt,
        open_runtime(_grpc_settings(mooncake.decode, "decode", mooncake.bootstrap_port)
                     ) as decode_rt,
    ):
        prefill_port, stop_prefill = await start_grpc_server(prefill_rt)
        decode_port, stop_decode = await start_grpc_server(decode_rt)
        try:
            result = await route(f"127.0.0.1:{prefill_port}", f"127.0.0.1:{decode_port}",
                                 prompt_ids, MAX_NEW_TOKENS, temperature=0.0,
                                 request_id="grpc-mooncake-1", timeout_s=120.0)
        finally:
            await stop_decode(1.0)
            await stop_prefill(1.0)

    assert result.token_ids == [int(t) for t in baseline["token_ids"]]
    assert result.finish_reason == ("length" if baseline["finish_reason"] == "length" else "stop")
    assert metric_value(mooncake.decode, EXTERNAL_HITS) - hits_before >= len(prompt_ids) - 1


def test_sidecar_mooncake_bodies_validate_against_vllm_models(
    mooncake: MooncakePair, vllm_schema: VllmSchema
) -> None:
    settings = Settings.model_validate({"mooncake_bootstrap_port": mooncake.bootstrap_port})
    handler = dialect_class("vllm", "mooncake")(DialectSetup(settings))
    engine_id = engine_id_from_query(json.loads(get_text(mooncake.bootstrap_addr + "/query")))
    items: list[Any] = []
    for kind, path in (("completion", Route.COMPLETIONS), ("chat", Route.CHAT)):
        body = _body(kind, f"mooncake-schema-{kind}", stream=True,
                     stream_options={"include_usage": True}, min_tokens=2)
        ctx = HandoffContext(route=path, request_id="schema", advertise_host="127.0.0.1",
                             prefill=PrefillTarget("127.0.0.1", mooncake.prefill_engine.port))
        ctx = handler.begin(ctx)
        ctx = ctx.with_state(MooncakeState(ctx.state.transfer_id, engine_id))
        prefill = handler.prefill_body(body, ctx)
        decode = handler.decode_body(body, handler.handoff(None, ctx))
        items += [(kind, prefill), (kind, decode)]
    assert vllm_schema.validate_many(items) == [None] * len(items)
