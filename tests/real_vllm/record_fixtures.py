"""Records real vLLM prefill responses and decode requests into tests/fixtures/vllm/<version>/.

Run from the repository root, with the engine environment built (setup_env.sh):

    .venv/bin/python tests/real_vllm/record_fixtures.py [--only nixl|mooncake]

For each connector it starts a prefill engine and a decode engine (the same harness as the
suite), runs each case by hand and writes one JSON file per case, then stops the engines:
- NixlConnector (``nixl_*``): client body -> prefill body -> prefill reply -> decode body
  -> decode reply;
- MooncakeConnector (``mooncake_*``, TCP, vLLM patched for CPU by setup_env.sh): the
  prefill's bootstrap ``GET /query`` answer (``mooncake_query``), and exchanges whose
  prefill and decode legs run at once with one ``transfer_id`` and the engine id read from
  that answer.
Unit tests of the vLLM agents read these files instead of a live engine.

Deliberate limits: ids, the NIXL engine id, transfer ids, ports and timestamps differ on
every run, so a re-recording changes those values (and only those, for the same vLLM
version and model); ExampleConnector is not recorded (it carries no hand-off).
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: make ``real_vllm`` importable the way pytest's pythonpath does.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from real_vllm.client import (
    block_prompt,
    chat_body,
    completion_body,
    decode_body,
    get_text,
    mooncake_decode_body,
    mooncake_prefill_body,
    post_json,
    post_stream_raw,
    prefill_body,
)
from real_vllm.harness import (
    VLLM_VERSION,
    EngineEnv,
    EngineGroup,
    EngineSpec,
    mooncake_config,
    nixl_config,
)

FIXTURES_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / VLLM_VERSION
ROUTES = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}


def _cases() -> dict[str, tuple[str, dict[str, Any], bool]]:
    """File stem -> (kind, client body, decode streamed?)."""

    # One prompt per case, so that no prefill finds another case's prompt in its cache.
    def prompt(stem: str) -> str:
        return block_prompt(f"recorded fixture {stem}")

    return {
        "nixl_completion": ("completion", completion_body(prompt("completion")), False),
        "nixl_completion_stream": (
            "completion",
            completion_body(prompt("completion stream"), stream=True),
            True,
        ),
        "nixl_chat": ("chat", chat_body(prompt("chat")), False),
        "nixl_chat_stream": ("chat", chat_body(prompt("chat stream"), stream=True), True),
        # Shorter than one 32-token block: nothing to transfer, the hand-off still comes.
        "nixl_completion_short_prompt": ("completion", completion_body("def f(x):"), False),
    }


def record_case(
    prefill_url: str, decode_url: str, kind: str, body: dict[str, Any], stream: bool
) -> dict[str, Any]:
    route = ROUTES[kind]
    prefill_request = prefill_body(body)
    prefill_response = post_json(prefill_url + route, prefill_request)
    decode_request = decode_body(body, prefill_response)
    record: dict[str, Any] = {
        "vllm_version": VLLM_VERSION,
        "connector": "NixlConnector",
        "endpoint": route,
        "client_request": body,
        "prefill_request": prefill_request,
        "prefill_response": prefill_response,
        "decode_request": decode_request,
    }
    if stream:
        record["decode_response_sse"] = post_stream_raw(decode_url + route, decode_request)
    else:
        record["decode_response"] = post_json(decode_url + route, decode_request)
    return record


MOONCAKE_ENGINE_ID = "recorded-mooncake-prefill"


def _mooncake_cases() -> dict[str, tuple[str, dict[str, Any], bool]]:
    def prompt(stem: str) -> str:
        return block_prompt(f"recorded fixture mooncake {stem}")

    return {
        "mooncake_completion": ("completion", completion_body(prompt("completion")), False),
        "mooncake_chat_stream": ("chat", chat_body(prompt("chat stream"), stream=True), True),
    }


def record_mooncake_case(
    prefill_url: str, decode_url: str, bootstrap_addr: str, engine_id: str,
    kind: str, body: dict[str, Any], stream: bool,
) -> dict[str, Any]:
    route = ROUTES[kind]
    transfer_id = f"xfer-{uuid.uuid4().hex}"  # the sidecar's form (sidecar/ids.py)
    prefill_request = mooncake_prefill_body(body, transfer_id)
    decode_request = mooncake_decode_body(body, transfer_id, bootstrap_addr, engine_id)
    # Push flow: the decode asks the prefill for the KV while the prefill runs.
    with ThreadPoolExecutor(max_workers=2) as pool:
        prefill = pool.submit(post_json, prefill_url + route, prefill_request)
        if stream:
            decode = pool.submit(post_stream_raw, decode_url + route, decode_request)
        else:
            decode = pool.submit(post_json, decode_url + route, decode_request)
        prefill_response, decode_response = prefill.result(), decode.result()
    record: dict[str, Any] = {
        "vllm_version": VLLM_VERSION,
        "connector": "MooncakeConnector",
        "endpoint": route,
        "client_request": body,
        "transfer_id": transfer_id,
        "prefill_request": prefill_request,
        "prefill_response": prefill_response,
        "decode_request": decode_request,
        "decode_response_sse" if stream else "decode_response": decode_response,
    }
    return record


def _write(stem: str, record: dict[str, Any]) -> None:
    FIXTURES_DIR.mkdir(parents=True, exist_ok=True)
    path = FIXTURES_DIR / f"{stem}.json"
    path.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {path}")


def record_nixl(env: EngineEnv) -> None:
    specs = [
        EngineSpec("nixl-prefill", nixl_config("kv_producer"), cpu=0),
        EngineSpec("nixl-decode", nixl_config("kv_consumer"), cpu=1, prefix_caching=False),
    ]
    with EngineGroup(env) as group:
        engines = group.start(specs)
        prefill, decode = engines["nixl-prefill"].url, engines["nixl-decode"].url
        for stem, (kind, body, stream) in _cases().items():
            _write(stem, record_case(prefill, decode, kind, body, stream))


def record_mooncake(env: EngineEnv) -> None:
    specs = [
        EngineSpec("mooncake-prefill", mooncake_config("kv_producer", MOONCAKE_ENGINE_ID),
                   cpu=0),
        EngineSpec("mooncake-decode", mooncake_config("kv_consumer"), cpu=1,
                   prefix_caching=False),
    ]
    with EngineGroup(env) as group:
        engines = group.start(specs)
        prefill_engine, decode = engines["mooncake-prefill"], engines["mooncake-decode"].url
        bootstrap_addr = f"http://127.0.0.1:{prefill_engine.mooncake_bootstrap_port}"
        answer = json.loads(get_text(bootstrap_addr + "/query"))
        _write("mooncake_query", {
            "vllm_version": VLLM_VERSION,
            "connector": "MooncakeConnector",
            "endpoint": "GET /query",
            "prefill_engine_id": MOONCAKE_ENGINE_ID,
            "bootstrap_addr": bootstrap_addr,
            "query_response": answer,
        })
        for stem, (kind, body, stream) in _mooncake_cases().items():
            _write(stem, record_mooncake_case(prefill_engine.url, decode, bootstrap_addr,
                                              MOONCAKE_ENGINE_ID, kind, body, stream))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("nixl", "mooncake"), help="record one connector")
    args = parser.parse_args(argv)
    env = EngineEnv.locate()
    if args.only in (None, "nixl"):
        record_nixl(env)
    if args.only in (None, "mooncake"):
        record_mooncake(env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
