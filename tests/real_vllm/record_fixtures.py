"""Records real vLLM prefill responses and decode requests into tests/fixtures/vllm/<version>/.

Run from the repository root, with the engine environment built (setup_env.sh):

    .venv/bin/python tests/real_vllm/record_fixtures.py

It starts a NIXL prefill engine and a NIXL decode engine (the same harness as the suite),
runs each case by hand (client body -> prefill body -> prefill reply -> decode body ->
decode reply) and writes one JSON file per case, then stops the engines. Unit tests of the
vLLM agents read these files instead of a live engine.

Deliberate limits: ids, the NIXL engine id, ports and timestamps differ on every run, so a
re-recording changes those values (and only those, for the same vLLM version and model);
only the NixlConnector dialect is recorded (ExampleConnector carries no hand-off).
"""

from __future__ import annotations

import json
import sys
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
    post_json,
    post_stream_raw,
    prefill_body,
)
from real_vllm.harness import VLLM_VERSION, EngineEnv, EngineGroup, EngineSpec, nixl_config

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


def main() -> int:
    specs = [
        EngineSpec("nixl-prefill", nixl_config("kv_producer"), cpu=0),
        EngineSpec("nixl-decode", nixl_config("kv_consumer"), cpu=1, prefix_caching=False),
    ]
    with EngineGroup(EngineEnv.locate()) as group:
        engines = group.start(specs)
        prefill, decode = engines["nixl-prefill"].url, engines["nixl-decode"].url
        FIXTURES_DIR.mkdir(parents=True, exist_ok=True)
        for stem, (kind, body, stream) in _cases().items():
            record = record_case(prefill, decode, kind, body, stream)
            path = FIXTURES_DIR / f"{stem}.json"
            path.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
