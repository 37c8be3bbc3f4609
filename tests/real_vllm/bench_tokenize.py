"""What the cache rule's tokenization costs a request, on a real vLLM engine (CPU), and what the
alternatives would (issue 37: "what a request pays for the belief").

    cd tests && flock /tmp/real-vllm.lock ../.venv/bin/python -m real_vllm.bench_tokenize \\
        [--calls 20]

One engine (the tiny model, ``--enable-scale-out`` for vLLM's render endpoints, a context long
enough for 8k-token prompts), prompts of about 1k and 8k tokens (text from the standard
library's sources, which the tiny tokenizer was trained on), completions and chat. For each,
the median and p90 wall time of:

    tokenize   POST /tokenize (what the sidecar calls today), from this process over loopback
    render     POST /v1/completions/render, /v1/chat/completions/render (vLLM's own ids of
               the request as it would run it: template, special tokens, truncation)
    in-process the same tokenizer loaded from the model's files (``tokenizers``; chat:
               ``transformers``' chat template), timed inside the engine's environment (the
               sidecar's has neither library): what a sidecar that tokenized itself would pay

The sidecar's own CPU per request for the rule (its look-up, the ids' JSON) is
``bench.kv_index_cpu``'s. Deliberate limits: a tiny byte-level BPE vocabulary (2,048 tokens):
a production tokenizer (100k+ entries) costs more per token in every column alike; one
engine, idle but for these calls; a shared machine (the figures are medians of ``--calls``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path
from typing import Any

from real_vllm.harness import SERVED_MODEL_NAME, EngineEnv, EngineSpec, engine_group

SIZES = (1024, 8192)
MAX_MODEL_LEN = 16384

IN_PROCESS = r"""
import json, statistics, sys, time
from tokenizers import Tokenizer
from transformers import AutoTokenizer
model_dir, calls = sys.argv[1], int(sys.argv[2])
jobs = json.loads(sys.stdin.read())
fast = Tokenizer.from_file(model_dir + "/tokenizer.json")
auto = AutoTokenizer.from_pretrained(model_dir)
out = {}
for name, text in jobs.items():
    def once():
        if name.startswith("chat"):
            auto.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                     add_generation_prompt=True)
        else:
            fast.encode(text)
    once()
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        once()
        times.append((time.perf_counter() - started) * 1000)
    out[name] = times
print(json.dumps(out))
"""


def post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def stdlib_text() -> str:
    """Plenty of text the tiny tokenizer knows: the standard library's sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return "\n".join(path.read_text(errors="replace") for path in sorted(root.glob("*.py"))[:80])


def prompt_of(url: str, corpus: str, tokens: int) -> str:
    """A slice of ``corpus`` of about ``tokens`` tokens, by the engine's own count."""
    chars = tokens * 3
    for _ in range(8):
        count = post(url + "/tokenize", {"model": SERVED_MODEL_NAME,
                                         "prompt": corpus[:chars]})["count"]
        if abs(count - tokens) <= tokens // 50:
            break
        chars = int(chars * tokens / max(count, 1))
    return corpus[:chars]


def timed(calls: int, call: Any) -> list[float]:
    call()
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1000)
    return times


def summary(times: list[float]) -> str:
    ordered = sorted(times)
    p90 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]
    return f"{statistics.median(ordered):8.2f} / {p90:8.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m real_vllm.bench_tokenize",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args(argv)
    env = EngineEnv.locate()
    corpus = stdlib_text()
    rows: dict[str, dict[str, list[float]]] = {}
    with engine_group(env) as group:
        engine = group.start([EngineSpec(
            "tokenizer", extra_args=("--enable-scale-out", "--max-model-len",
                                     str(MAX_MODEL_LEN)),
            extra_env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})])["tokenizer"]
        url = engine.url
        jobs: dict[str, str] = {}
        for size in SIZES:
            text = prompt_of(url, corpus, size)
            jobs[f"completions {size}"] = jobs[f"chat {size}"] = text
            completion = {"model": SERVED_MODEL_NAME, "prompt": text, "max_tokens": 1}
            chat = {"model": SERVED_MODEL_NAME, "max_tokens": 1,
                    "messages": [{"role": "user", "content": text}]}
            rows[f"completions {size}"] = {
                "tokenize": timed(args.calls, lambda c=completion: post(
                    url + "/tokenize", {"model": SERVED_MODEL_NAME, "prompt": c["prompt"]})),
                "render": timed(args.calls, lambda c=completion: post(
                    url + "/v1/completions/render", c)),
            }
            rows[f"chat {size}"] = {
                "tokenize": timed(args.calls, lambda c=chat: post(
                    url + "/tokenize", {"model": SERVED_MODEL_NAME,
                                        "messages": c["messages"]})),
                "render": timed(args.calls, lambda c=chat: post(
                    url + "/v1/chat/completions/render", c)),
            }
    done = subprocess.run([str(env.python), "-c", IN_PROCESS, str(env.model_dir),
                           str(args.calls)], input=json.dumps(jobs), capture_output=True,
                          text=True, check=True)
    for name, times in json.loads(done.stdout).items():
        rows[name]["in-process"] = times
    print(f"{'prompt':<18} {'tokenize p50 / p90 ms':>22} {'render p50 / p90 ms':>22} "
          f"{'in-process p50 / p90 ms':>24}")
    for name, columns in rows.items():
        print(f"{name:<18} {summary(columns['tokenize']):>22} {summary(columns['render']):>22} "
              f"{summary(columns['in-process']):>24}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
