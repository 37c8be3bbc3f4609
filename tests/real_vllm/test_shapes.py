"""Real vLLM engines (CPU) answering the request shapes of issue #14 through the sidecar:

- ``n = 3`` and a batch of 3 prompts, JSON and streamed, through the NIXL pair: every choice
  equals the baseline engine's single greedy answer for its prompt (batch answer i equals
  prompt i's), choices are indexed as vLLM indexes them, usage is summed, and the KV really
  moved for each sub-request (the decode engine, without a prefix cache, counts external
  cache hits for every one of them);
- conditional disaggregation (``--local-prefill-max-tokens``) with ``--prompt-length-source
  tokenize`` against the real engine's ``/tokenize``: a prompt under the threshold is answered
  with no request reaching the prefill engine and equals the baseline; a prompt whose byte
  estimate is under the threshold but whose real token count is over it is disaggregated
  (the tokenizer decided, not the estimate).
"""

from __future__ import annotations

import json
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest

from real_vllm.client import block_prompt, completion_body, metric_value, post_json, text_of
from real_vllm.sidecar_process import PATIENT_TOKENIZE, Sidecar, sidecar_process
from real_vllm.stack import RealVllm
from sidecar.protocol.context import Route
from sidecar.protocol.prompt_length import estimate_tokens

COMPLETIONS = "/v1/completions"
HEADER = "x-prefiller-host-port"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
PREFILL_PROMPT_TOKENS = "vllm:prompt_tokens_total"
#: The local-prefill threshold of the conditional sidecar, in tokens.
THRESHOLD = 40


@pytest.fixture(scope="module")
def shapes_sidecar(real_vllm: RealVllm, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[Sidecar]:
    yield from sidecar_process(
        tmp_path_factory.mktemp("shapes-sidecar"),
        "--engine", "vllm", "--kv-connector", "shfs", "--engine-url", real_vllm.nixl.decode,
    )


@pytest.fixture(scope="module")
def conditional_sidecar(real_vllm: RealVllm, tmp_path_factory: pytest.TempPathFactory
                        ) -> Iterator[Sidecar]:
    yield from sidecar_process(
        tmp_path_factory.mktemp("conditional-sidecar"),
        "--engine", "vllm", "--kv-connector", "shfs", "--engine-url", real_vllm.nixl.decode,
        "--local-prefill-max-tokens", str(THRESHOLD), "--prompt-length-source", "tokenize",
        *PATIENT_TOKENIZE,
    )


def _post(sidecar: Sidecar, body: dict[str, Any], target: str) -> str:
    request = urllib.request.Request(
        sidecar.url + COMPLETIONS, data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", HEADER: target}, method="POST",
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        assert response.status == 200
        return str(response.read().decode())


def _choices(raw: str, stream: bool) -> tuple[dict[int, str], dict[str, Any]]:
    """Text per choice index, and the usage, of a JSON or streamed answer."""
    texts: dict[int, str] = defaultdict(str)
    if not stream:
        answer = json.loads(raw)
        for choice in answer["choices"]:
            texts[choice["index"]] = choice["text"]
        return dict(texts), answer["usage"]
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    usage: dict[str, Any] = {}
    for event in events[:-1]:
        chunk = json.loads(event)
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice.get("text") or ""
        if chunk.get("usage"):
            usage = chunk["usage"]
    return dict(texts), usage


def _baseline(real_vllm: RealVllm, prompt: str) -> dict[str, Any]:
    return post_json(real_vllm.baseline + COMPLETIONS, completion_body(prompt))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("shape", ["n3", "batch3"])
def test_shapes_equal_the_greedy_baseline_with_the_kv_moved_for_each(
    real_vllm: RealVllm, shapes_sidecar: Sidecar, shape: str, stream: bool
) -> None:
    tag = f"shapes-{shape}-{stream}"
    prompts = [block_prompt(tag)] if shape == "n3" else [
        block_prompt(f"{tag}-{i}") for i in range(3)]
    baselines = [_baseline(real_vllm, prompt) for prompt in prompts]
    expected = [text_of(b) for b in baselines]
    assert all(expected)
    body = completion_body(prompts[0] if shape == "n3" else prompts,
                           stream=stream, **({"n": 3} if shape == "n3" else {}))
    if stream:
        body["stream_options"] = {"include_usage": True}
    decode = real_vllm.nixl.decode
    hits_before = metric_value(decode, EXTERNAL_HITS)

    texts, usage = _choices(_post(shapes_sidecar, body, real_vllm.nixl.prefill_hostport), stream)

    assert sorted(texts) == [0, 1, 2]
    for k in range(3):
        assert texts[k] == expected[0 if shape == "n3" else k], k
    prompt_tokens = [b["usage"]["prompt_tokens"] for b in baselines]
    assert usage["prompt_tokens"] == sum(prompt_tokens)
    assert usage["completion_tokens"] == 3 * baselines[0]["usage"]["completion_tokens"]
    # Every sub-request loaded every prompt token but its last from the prefill engine.
    per_request = prompt_tokens * 3 if shape == "n3" else prompt_tokens
    assert metric_value(decode, EXTERNAL_HITS) - hits_before >= sum(
        t - 1 for t in per_request)


def _tokens(real_vllm: RealVllm, prompt: str) -> int:
    count = post_json(real_vllm.baseline + "/tokenize", {"prompt": prompt})["count"]
    assert isinstance(count, int)
    return count


def test_a_short_prompt_never_reaches_the_prefill_engine_and_equals_the_baseline(
    real_vllm: RealVllm, conditional_sidecar: Sidecar
) -> None:
    prompt = "# shapes-short\ndef f(x):\n    return x"
    assert _tokens(real_vllm, prompt) <= THRESHOLD
    expected = text_of(_baseline(real_vllm, prompt))
    prefill = real_vllm.nixl.prefill
    before = metric_value(prefill, PREFILL_PROMPT_TOKENS)
    for stream in (False, True):
        texts, _ = _choices(_post(conditional_sidecar, completion_body(prompt, stream=stream),
                                  real_vllm.nixl.prefill_hostport), stream)
        assert texts == {0: expected}
    assert metric_value(prefill, PREFILL_PROMPT_TOKENS) == before


def test_the_real_tokenizer_decides_not_the_estimate(
    real_vllm: RealVllm, conditional_sidecar: Sidecar
) -> None:
    # Code tokenizes finer than 4 bytes per token: under the threshold by the estimate,
    # over it by the engine's tokenizer, so only a tokenize call disaggregates it.
    prompt = "# shapes-tokenize\n" + "\n".join(f"v{i} = g({i})" for i in range(9))
    estimate = estimate_tokens(Route.COMPLETIONS, {"prompt": prompt})
    real = _tokens(real_vllm, prompt)
    assert estimate <= THRESHOLD < real, (estimate, real)
    expected = text_of(_baseline(real_vllm, prompt))
    prefill = real_vllm.nixl.prefill
    before = metric_value(prefill, PREFILL_PROMPT_TOKENS)
    texts, _ = _choices(_post(conditional_sidecar, completion_body(prompt),
                              real_vllm.nixl.prefill_hostport), False)
    assert texts == {0: expected}
    assert metric_value(prefill, PREFILL_PROMPT_TOKENS) - before >= real
