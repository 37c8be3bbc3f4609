"""Real vLLM engines on CPU, prefill/decode disaggregated by hand (no sidecar).

Proves: the harness starts a working stack; with NixlConnector, prefill (``max_tokens=1``,
the ``kv_transfer_params`` skeleton) then decode (the returned params, ``remote_host``
127.0.0.1) gives the baseline engine's greedy output, for completions and chat, JSON and
streamed, on a prompt of several 32-token blocks; the KV really moves (NIXL transfer and
external prefix-cache metrics grow) and is really used (reversing ``remote_block_ids``
changes the output); ExampleConnector gives the baseline output too; the bodies built here
pass vLLM's own request models; the NIXL start-up hook is active in the engines: NIXL's
progress thread has its poll delay, and each NIXL worker's main thread (the one that runs the
model) is on its engine's core, not moved by vLLM to the machine's last core.

Does not prove anything about the sidecar: it only fixes what the sidecar must reproduce.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import psutil
import pytest

from real_vllm.client import (
    block_prompt,
    chat_body,
    completion_body,
    decode_body,
    metric_value,
    post_json,
    post_stream,
    prefill_body,
    text_of,
    text_of_stream,
)
from real_vllm.engine_schema import VllmSchema
from real_vllm.harness import BLOCK_SIZE
from real_vllm.stack import RealVllm

ROUTES = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"


def _body(kind: str, tag: str) -> dict[str, Any]:
    prompt = block_prompt(tag)
    return completion_body(prompt) if kind == "completion" else chat_body(prompt)


def _baseline_text(stack: RealVllm, kind: str, body: dict[str, Any]) -> str:
    return text_of(post_json(stack.baseline + ROUTES[kind], body))


def _nixl_prefill(stack: RealVllm, kind: str, body: dict[str, Any]) -> dict[str, Any]:
    return post_json(stack.nixl.prefill + ROUTES[kind], prefill_body(body))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_nixl_pd_output_equals_baseline(real_vllm: RealVllm, kind: str, stream: bool) -> None:
    body = _body(kind, f"nixl-{kind}-{stream}")
    expected = _baseline_text(real_vllm, kind, body)
    reply = _nixl_prefill(real_vllm, kind, body)
    decode = decode_body(body, reply)
    url = real_vllm.nixl.decode + ROUTES[kind]
    if stream:
        decode["stream"] = True
        got = text_of_stream(post_stream(url, decode))
    else:
        got = text_of(post_json(url, decode))
    assert expected
    assert got == expected


def test_nixl_moves_the_prompt_kv(real_vllm: RealVllm) -> None:
    body = _body("completion", "nixl-metrics")
    decode_url = real_vllm.nixl.decode
    bytes_before = metric_value(decode_url, NIXL_BYTES)
    hits_before = metric_value(decode_url, EXTERNAL_HITS)
    reply = _nixl_prefill(real_vllm, "completion", body)
    prompt_tokens = reply["usage"]["prompt_tokens"]
    assert prompt_tokens >= 3 * BLOCK_SIZE
    params = reply["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert sum(len(group) for group in params["remote_block_ids"]) >= 3
    post_json(decode_url + ROUTES["completion"], decode_body(body, reply))
    assert metric_value(decode_url, NIXL_BYTES) > bytes_before
    # Every prompt token but the last is loaded from the prefill engine.
    assert metric_value(decode_url, EXTERNAL_HITS) - hits_before >= prompt_tokens - 1


def test_nixl_reversed_blocks_change_output(real_vllm: RealVllm) -> None:
    body = _body("completion", "nixl-reversed")
    expected = _baseline_text(real_vllm, "completion", body)
    reply = _nixl_prefill(real_vllm, "completion", body)
    decode = decode_body(body, reply)
    groups = decode["kv_transfer_params"]["remote_block_ids"]
    decode["kv_transfer_params"]["remote_block_ids"] = [list(reversed(g)) for g in groups]
    got = text_of(post_json(real_vllm.nixl.decode + ROUTES["completion"], decode))
    assert got != expected


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_example_connector_pd_output_equals_baseline(real_vllm: RealVllm, kind: str) -> None:
    body = _body(kind, f"example-{kind}")
    expected = _baseline_text(real_vllm, kind, body)
    hits_before = metric_value(real_vllm.example.decode, EXTERNAL_HITS)
    prefill = copy.deepcopy(body)
    prefill["max_tokens"] = 1
    post_json(real_vllm.example.prefill + ROUTES[kind], prefill)
    got = text_of(post_json(real_vllm.example.decode + ROUTES[kind], body))
    assert got == expected
    # The decode engine loaded the prompt's KV from the shared storage.
    assert metric_value(real_vllm.example.decode, EXTERNAL_HITS) > hits_before


def test_pd_bodies_pass_vllm_request_models(real_vllm: RealVllm, vllm_schema: VllmSchema) -> None:
    items: list[Any] = []
    for kind in ("completion", "chat"):
        body = _body(kind, f"schema-{kind}")
        reply = _nixl_prefill(real_vllm, kind, body)
        items += [(kind, prefill_body(body)), (kind, decode_body(body, reply))]
    bad = completion_body("x")
    bad["max_tokens"] = "many"
    items.append(("completion", bad))
    verdicts = vllm_schema.validate_many(items)
    assert verdicts[:-1] == [None] * (len(items) - 1)
    assert verdicts[-1] is not None
    assert "max_tokens" in verdicts[-1]


def test_nixl_engines_run_with_progress_thread_delay(real_vllm: RealVllm) -> None:
    for engine in (real_vllm.nixl.prefill_engine, real_vllm.nixl.decode_engine):
        assert "disagg_nixl_hook: NIXL pthrDelay=" in engine.log_path.read_text(errors="replace")


def test_nixl_workers_stay_on_their_engines_cores(real_vllm: RealVllm) -> None:
    for engine in (real_vllm.nixl.prefill_engine, real_vllm.nixl.decode_engine):
        workers = [p for p in psutil.Process(engine.process.pid).children(recursive=True)
                   if "Worker" in p.name()]
        assert len(workers) == 1, workers
        # The worker process's main thread (its tid is the pid): vLLM's NIXL worker would
        # have moved it to the last core (core 1 here) whatever the engine's pinning.
        assert os.sched_getaffinity(workers[0].pid) == {engine.spec.cpu}, engine.spec
        assert "disagg_nixl_hook: NIXL worker keeps its cores" in engine.log_path.read_text(
            errors="replace")
