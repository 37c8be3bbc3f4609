"""Records real vLLM 0.32 answers on issue 21's PD routes into tests/fixtures/vllm/0.32.0/routes/.

Run from the repository root, with the engine environment built (setup_env.sh):

    .venv/bin/python tests/real_vllm/record_routes.py [--only nixl|defaults|mooncake]

Phases (each starts at most three engines, runs its cases, stops them):
- ``nixl``: a baseline engine (no connector) and a NIXL pair, all three with
  ``--enable-scale-out --enable-prompt-tokens-details``. For completions, chat, responses,
  messages and generate, JSON and streamed: client body -> prefill body -> prefill reply ->
  decode body -> decode reply, the baseline's reply to the client body, both outputs read
  and compared, and the decode's ``vllm:external_prefix_cache_hits_total`` growth
  (``<route>_nixl[_stream].json``); the usage each leg and the baseline report, cold and
  with a prefix-cache hit (``usage_details_on.json``); the decode's answer when the prefill
  it names is dead, per route, JSON and streamed (``errors_midstream.json``); errors sent
  before any byte (``errors_before_stream.json``); what the Responses API does with
  ``previous_response_id`` / ``background`` on an engine without a store
  (``responses_state_store_off.json``); the official SDKs against the baseline and against
  a failing decode (``sdk.json``).
- ``defaults``: the same three engines with vLLM's default flags and
  ``VLLM_ENABLE_RESPONSES_API_STORE=1``: ``/inference/v1/generate`` without
  ``--enable-scale-out`` (``generate_disabled.json``), usage without
  ``--enable-prompt-tokens-details`` (``usage_details_off.json``), the Responses store
  through a PD pair (``responses_state_store_on.json``).
- ``mooncake``: a baseline and a MooncakeConnector pair (TCP, CPU patch from setup_env.sh),
  responses / messages / generate, JSON and streamed, both legs at once
  (``<route>_mooncake[_stream].json``).

Deliberate limits: ids, engine ids, ports, block ids and timestamps change on every run;
the tiny random model has no meaningful text (equality with the baseline is the check);
Messages has no ``ignore_eos``, so its outputs may end early with ``end_turn``.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from real_vllm.client import block_prompt, get_text, metric_value, post_json
from real_vllm.harness import (
    VLLM_VERSION,
    EngineEnv,
    EngineGroup,
    EngineSpec,
    mooncake_config,
    nixl_config,
)
from real_vllm.raw_http import RawReply, get_raw, post_raw
from real_vllm.route_bodies import ROUTES, RouteSpec, with_handoff

OUT_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / VLLM_VERSION / "routes"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
DETAILS_FLAGS = ("--enable-scale-out", "--enable-prompt-tokens-details")
STORE_ENV = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
MOONCAKE_ENGINE_ID = "recorded-routes-mooncake-prefill"
PD_ROUTES = ("completions", "chat", "responses", "messages", "generate")
NEW_ROUTES = ("responses", "messages", "generate")


def _write(name: str, record: dict[str, Any]) -> None:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / f"{name}.json"
    path.write_text(json.dumps({"vllm_version": VLLM_VERSION, **record}, indent=2,
                               ensure_ascii=False) + "\n")
    print(f"wrote {path}", flush=True)


class Stack:
    """Three running engines: a baseline and a prefill/decode pair."""

    def __init__(self, baseline: str, prefill: str, decode: str) -> None:
        self.baseline, self.prefill, self.decode = baseline, prefill, decode
        self._token_ids: dict[str, list[int]] = {}

    def token_ids(self, prompt: str) -> list[int]:
        if prompt not in self._token_ids:
            reply = post_json(self.baseline + "/tokenize", {"model": "tiny", "prompt": prompt})
            self._token_ids[prompt] = list(reply["tokens"])
        return self._token_ids[prompt]

    def client_body(self, spec: RouteSpec, tag: str, stream: bool) -> dict[str, Any]:
        prompt = block_prompt(tag)
        return spec.client_body(self.token_ids(prompt) if spec.takes_token_ids else prompt,
                                stream=stream)


def _output(spec: RouteSpec, reply: RawReply, stream: bool) -> Any:
    if reply.status != 200:
        return None
    return spec.stream_output(reply.body) if stream else spec.output(reply.json())


def _answer(reply: RawReply, stream: bool) -> dict[str, Any]:
    if stream:
        return {"status": reply.status, "sse": reply.body, "complete": reply.complete}
    return {"status": reply.status, "json": reply.json()}


def _nixl_handoff(prefill_reply: dict[str, Any]) -> dict[str, Any]:
    params = prefill_reply.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise AssertionError(f"prefill reply has no kv_transfer_params: {prefill_reply}")
    return {**params, "remote_host": "127.0.0.1"}


def nixl_exchange(stack: Stack, spec: RouteSpec, tag: str, stream: bool) -> dict[str, Any]:
    """Baseline, then prefill -> decode with NIXL; outputs compared, hits counted."""
    body = stack.client_body(spec, tag, stream)
    baseline = post_raw(stack.baseline + spec.path, body)
    prefill_request = spec.prefill_request(body)
    prefill_reply = post_json(stack.prefill + spec.path, prefill_request)
    decode_request = with_handoff(body, _nixl_handoff(prefill_reply))
    hits_before = metric_value(stack.decode, EXTERNAL_HITS)
    decode = post_raw(stack.decode + spec.path, decode_request)
    hits = metric_value(stack.decode, EXTERNAL_HITS) - hits_before
    expected, got = _output(spec, baseline, stream), _output(spec, decode, stream)
    return {
        "connector": "NixlConnector",
        "endpoint": spec.path,
        "client_request": body,
        "baseline_response": _answer(baseline, stream),
        "prefill_request": prefill_request,
        "prefill_response": prefill_reply,
        "decode_request": decode_request,
        "decode_response": _answer(decode, stream),
        "baseline_output": expected,
        "decode_output": got,
        "decode_equals_baseline": expected == got and got is not None,
        "decode_external_prefix_cache_hits": hits,
    }


def usage_matrix(stack: Stack, routes: tuple[str, ...]) -> dict[str, Any]:
    """Per route: baseline cold and warm, PD cold and PD warm (the prefill then hits)."""
    out: dict[str, Any] = {}
    for name in routes:
        spec = ROUTES[name]
        body = stack.client_body(spec, f"usage matrix {name}", stream=False)
        cold = post_json(stack.baseline + spec.path, body)
        warm = post_json(stack.baseline + spec.path, body)
        legs = []
        for _ in range(2):
            prefill = post_json(stack.prefill + spec.path, spec.prefill_request(body))
            params = _nixl_handoff(prefill)
            decode = post_json(stack.decode + spec.path, with_handoff(body, params))
            legs.append({
                "prefill_usage": prefill.get("usage"),
                "remote_prefill_cached_tokens": params.get("remote_prefill_cached_tokens"),
                "decode_usage": decode.get("usage"),
            })
        out[name] = {"endpoint": spec.path, "baseline_cold": cold.get("usage"),
                     "baseline_warm": warm.get("usage"), "pd_cold": legs[0],
                     "pd_prefill_warm": legs[1]}
    return out


def _dead_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def dead_prefill_params(stack: Stack) -> dict[str, Any]:
    """Real NIXL decode params whose prefill engine does not exist (unknown id, closed port)."""
    spec = ROUTES["completions"]
    body = stack.client_body(spec, "dead prefill", stream=False)
    params = _nixl_handoff(post_json(stack.prefill + spec.path, spec.prefill_request(body)))
    return {**params, "remote_engine_id": str(uuid.uuid4()), "remote_port": _dead_port()}


def midstream_errors(stack: Stack) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in PD_ROUTES:
        spec = ROUTES[name]
        for stream in (False, True):
            body = stack.client_body(spec, "dead prefill", stream)
            # A fresh engine id each time: every request does its own failed handshake.
            request = with_handoff(body, dead_prefill_params(stack))
            reply = post_raw(stack.decode + spec.path, request)
            out[f"{name}{'_stream' if stream else ''}"] = {
                "endpoint": spec.path, "request": request, "reply": reply.record()}
    out["decode_healthy_after"] = get_raw(stack.decode + "/health").status
    return out


def errors_before_stream(stack: Stack) -> dict[str, Any]:
    prompt = "def f(x):"
    cases: dict[str, tuple[str, dict[str, Any]]] = {
        "messages_missing_max_tokens": (
            "/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": prompt}]}),
        "messages_unknown_model": (
            "/v1/messages", {"model": "nope", "max_tokens": 4, "stream": True,
                             "messages": [{"role": "user", "content": prompt}]}),
        "responses_unknown_model": (
            "/v1/responses", {"model": "nope", "input": prompt, "stream": True}),
        "responses_bad_max_output_tokens": (
            "/v1/responses", {"model": "tiny", "input": prompt, "max_output_tokens": "x"}),
        "generate_unknown_model": (
            "/inference/v1/generate", {"model": "nope", "token_ids": [1, 2],
                                       "sampling_params": {}, "stream": True}),
        "generate_empty_token_ids": (
            "/inference/v1/generate", {"token_ids": [], "sampling_params": {}}),
        "generate_bad_sampling_params": (
            "/inference/v1/generate", {"token_ids": [1, 2],
                                       "sampling_params": {"max_tokens": -1}}),
        # vLLM's prefill answer is never streamed: what a stream asked of a prefill returns.
        "responses_prefill_stream_true": (
            "/v1/responses", {"model": "tiny", "input": prompt, "max_output_tokens": 1,
                              "stream": True, "kv_transfer_params": {
                                  "do_remote_decode": True, "do_remote_prefill": False}}),
    }
    out: dict[str, Any] = {}
    for name, (path, body) in cases.items():
        target = stack.prefill if name.endswith("prefill_stream_true") else stack.decode
        reply = post_raw(target + path, body)
        out[name] = {"endpoint": path, "request": body, "reply": reply.record()}
    return out


def responses_state_store_off(stack: Stack) -> dict[str, Any]:
    """An engine without VLLM_ENABLE_RESPONSES_API_STORE: what the state fields do."""
    base = {"model": "tiny", "max_output_tokens": 4, "temperature": 0, "ignore_eos": True}
    first = post_raw(stack.decode + "/v1/responses", {**base, "input": "def f(x):"})
    first_id = first.json()["id"]
    return {
        "engine": "decode (NIXL consumer), VLLM_ENABLE_RESPONSES_API_STORE unset",
        "first": first.record(),
        "get_first": get_raw(f"{stack.decode}/v1/responses/{first_id}").record(),
        "previous_response_id_of_first": post_raw(
            stack.decode + "/v1/responses",
            {**base, "input": "more", "previous_response_id": first_id}).record(),
        "background_true": post_raw(
            stack.decode + "/v1/responses", {**base, "input": "x", "background": True}).record(),
        "background_true_store_false": post_raw(
            stack.decode + "/v1/responses",
            {**base, "input": "x", "background": True, "store": False}).record(),
    }


def sdk_runs(env: EngineEnv, stack: Stack) -> dict[str, Any]:
    probe = Path(__file__).resolve().parent / "sdk_probe.py"
    prompt = block_prompt("sdk probe")

    def run(*extra: str) -> Any:
        done = subprocess.run([str(env.python), str(probe), "--prompt", prompt, *extra],
                              capture_output=True, text=True, timeout=300, check=True)
        return json.loads(done.stdout)

    against_baseline = run("--base", stack.baseline)
    responses, messages = ROUTES["responses"], ROUTES["messages"]
    raw_responses = post_json(stack.baseline + responses.path, responses.client_body(prompt))
    raw_messages = post_json(stack.baseline + messages.path, messages.client_body(prompt))
    bad = json.dumps(dead_prefill_params(stack))
    return {
        "prompt": prompt,
        "against_baseline": against_baseline,
        "raw_http_text": {"responses": responses.output(raw_responses),
                          "messages": messages.output(raw_messages)},
        "against_decode_with_dead_prefill": run("--base", stack.decode, "--bad-kv", bad),
    }


def _start(group: EngineGroup, specs: list[EngineSpec]) -> Stack:
    engines = group.start(specs)
    names = [s.name for s in specs]
    return Stack(*(engines[n].url for n in names))


def record_nixl(env: EngineEnv) -> None:
    with EngineGroup(env) as group:
        stack = _start(group, [
            EngineSpec("baseline", None, cpu=0, extra_args=DETAILS_FLAGS),
            EngineSpec("nixl-prefill", nixl_config("kv_producer"), cpu=0, extra_args=DETAILS_FLAGS),
            EngineSpec("nixl-decode", nixl_config("kv_consumer"), cpu=1, prefix_caching=False,
                       extra_args=DETAILS_FLAGS),
        ])
        flags = {"engine_flags": list(DETAILS_FLAGS)}
        for name in PD_ROUTES:
            for stream in (False, True):
                stem = f"{name}_nixl{'_stream' if stream else ''}"
                _write(stem, flags | nixl_exchange(stack, ROUTES[name], f"routes {stem}", stream))
        _write("usage_details_on", flags | {"routes": usage_matrix(stack, PD_ROUTES)})
        _write("errors_before_stream", flags | {"cases": errors_before_stream(stack)})
        _write("responses_state_store_off", flags | responses_state_store_off(stack))
        _write("sdk", flags | sdk_runs(env, stack))
        _write("errors_midstream", flags | {"cases": midstream_errors(stack)})


def responses_state_store_on(stack: Stack) -> dict[str, Any]:
    """All three engines store responses; the decode leg of a PD pair stores the answer."""
    spec = ROUTES["responses"]
    body = {**spec.client_body(block_prompt("store through pd")), "store": True}
    prefill_request = {**spec.prefill_request(body), "store": True}  # as if forwarded
    prefill = post_json(stack.prefill + spec.path, prefill_request)
    decode = post_json(stack.decode + spec.path, with_handoff(body, _nixl_handoff(prefill)))
    follow = {"model": "tiny", "input": "next turn", "max_output_tokens": 4, "temperature": 0,
              "ignore_eos": True, "previous_response_id": decode["id"]}
    def stored(engine: str, response_id: str) -> dict[str, Any]:
        return get_raw(f"{engine}/v1/responses/{response_id}").record()

    background = post_raw(stack.decode + spec.path,
                          {**spec.client_body(block_prompt("background")), "background": True})
    return {
        "engines": "baseline, NIXL prefill, NIXL decode, all VLLM_ENABLE_RESPONSES_API_STORE=1",
        "prefill_request_store_true": prefill_request,
        "prefill_response_id": prefill["id"],
        "get_prefill_response_on_prefill": stored(stack.prefill, prefill["id"]),
        "decode_response_id": decode["id"],
        "get_decode_response_on_decode": stored(stack.decode, decode["id"]),
        "get_decode_response_on_prefill": stored(stack.prefill, decode["id"]),
        "follow_up_on_decode": post_raw(stack.decode + spec.path, follow).record(),
        "follow_up_on_prefill": post_raw(stack.prefill + spec.path, follow).record(),
        "follow_up_on_baseline": post_raw(stack.baseline + spec.path, follow).record(),
        "background_on_decode": background.record(),
    }


def record_defaults(env: EngineEnv) -> None:
    with EngineGroup(env) as group:
        stack = _start(group, [
            EngineSpec("baseline", None, cpu=0, extra_env=STORE_ENV),
            EngineSpec("nixl-prefill", nixl_config("kv_producer"), cpu=0, extra_env=STORE_ENV),
            EngineSpec("nixl-decode", nixl_config("kv_consumer"), cpu=1, prefix_caching=False,
                       extra_env=STORE_ENV),
        ])
        flags = {"engine_flags": [], "engine_env": STORE_ENV}
        spec = ROUTES["generate"]
        body = spec.client_body([1, 2, 3])
        _write("generate_disabled", flags | {
            "endpoint": spec.path, "request": body,
            "reply": post_raw(stack.baseline + spec.path, body).record(),
            "reply_stream": post_raw(stack.baseline + spec.path,
                                     {**body, "stream": True}).record()})
        # Without --enable-scale-out there is no generate route to measure.
        _write("usage_details_off", flags | {"routes": usage_matrix(stack, PD_ROUTES[:4])})
        _write("responses_state_store_on", flags | responses_state_store_on(stack))


def mooncake_exchange(stack: Stack, bootstrap: str, spec: RouteSpec, tag: str,
                      stream: bool) -> dict[str, Any]:
    body = stack.client_body(spec, tag, stream)
    baseline = post_raw(stack.baseline + spec.path, body)
    transfer_id = f"xfer-{uuid.uuid4().hex}"
    prefill_request = spec.prefill_body(body)
    prefill_request["kv_transfer_params"] = {
        "do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}
    decode_request = with_handoff(body, {
        "do_remote_decode": False, "do_remote_prefill": True, "transfer_id": transfer_id,
        "remote_bootstrap_addr": bootstrap, "remote_engine_id": MOONCAKE_ENGINE_ID})
    hits_before = metric_value(stack.decode, EXTERNAL_HITS)
    with ThreadPoolExecutor(max_workers=2) as pool:  # push flow: both legs at once
        prefill = pool.submit(post_json, stack.prefill + spec.path, prefill_request)
        decode = pool.submit(post_raw, stack.decode + spec.path, decode_request)
        prefill_reply, decode_reply = prefill.result(), decode.result()
    hits = metric_value(stack.decode, EXTERNAL_HITS) - hits_before
    expected, got = _output(spec, baseline, stream), _output(spec, decode_reply, stream)
    return {
        "connector": "MooncakeConnector",
        "endpoint": spec.path,
        "client_request": body,
        "transfer_id": transfer_id,
        "baseline_response": _answer(baseline, stream),
        "prefill_request": prefill_request,
        "prefill_response": prefill_reply,
        "decode_request": decode_request,
        "decode_response": _answer(decode_reply, stream),
        "baseline_output": expected,
        "decode_output": got,
        "decode_equals_baseline": expected == got and got is not None,
        "decode_external_prefix_cache_hits": hits,
    }


def record_mooncake(env: EngineEnv) -> None:
    if not env.mooncake_ready:
        raise SystemExit(f"Mooncake is not set up in {env.root}: run setup_env.sh")
    with EngineGroup(env) as group:
        engines = group.start([
            EngineSpec("baseline", None, cpu=0, extra_args=DETAILS_FLAGS),
            EngineSpec("mooncake-prefill", mooncake_config("kv_producer", MOONCAKE_ENGINE_ID),
                       cpu=0, extra_args=DETAILS_FLAGS),
            EngineSpec("mooncake-decode", mooncake_config("kv_consumer"), cpu=1,
                       prefix_caching=False, extra_args=DETAILS_FLAGS),
        ])
        stack = Stack(engines["baseline"].url, engines["mooncake-prefill"].url,
                      engines["mooncake-decode"].url)
        bootstrap = f"http://127.0.0.1:{engines['mooncake-prefill'].mooncake_bootstrap_port}"
        get_text(bootstrap + "/query")  # the bootstrap server is up
        flags = {"engine_flags": list(DETAILS_FLAGS)}
        for name in NEW_ROUTES:
            for stream in (False, True):
                stem = f"{name}_mooncake{'_stream' if stream else ''}"
                _write(stem, flags | mooncake_exchange(stack, bootstrap, ROUTES[name],
                                                       f"routes {stem}", stream))


PHASES: dict[str, Callable[[EngineEnv], None]] = {
    "nixl": record_nixl, "defaults": record_defaults, "mooncake": record_mooncake}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--only", choices=sorted(PHASES), help="record one phase")
    args = parser.parse_args(argv)
    env = EngineEnv.locate()
    for name, phase in PHASES.items():
        if args.only in (None, name):
            print(f"== phase {name}", flush=True)
            phase(env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
