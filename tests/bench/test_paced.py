"""The paced mode's parts: paced lean stubs, token timing in the load client, the bare relay,
and ``python -m bench.run --mode paced --quick`` end to end.

Proves: a lean stub with ``ttft``/``itl`` sends the same chunks as without, no sooner than its
schedule allows (the last token not before ``ttft + (n - 1) * itl``; a non-streamed answer
not before the same time); the load client stamps each token event and reports one gap per
pair of tokens ([DONE] excluded) and counts events into a shared tally as they arrive; the
bare relay forwards an exchange byte for byte; the paced run measures every way (direct,
bare relay, before, sidecar with 1 and 2 workers) on both flows without errors, with CPU and
system calls per token for the relaying processes, and prints its table. Does not prove
speed: the quick run is a few streams on a shared machine.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from test_lean_engine import PROMPT, dechunk, raw_exchange, request

from bench import paced, procs
from bench.lean_client import Client, EventTally, Origin
from sidecar.tools.stubs.lean.server import run_lean

REPO = Path(__file__).resolve().parents[2]
TTFT_S, ITL_S, TOKENS = 0.04, 0.02, 4
#: Timers may fire up to a clock tick early (libuv rounds to milliseconds).
EARLY_S = 0.005


def choices(raw: bytes) -> list[object]:
    """Each chunk's event with its per-request fields (id, created) left out."""
    events = []
    for chunk in dechunk(raw):
        data = chunk.removeprefix(b"data: ")
        events.append(data if data.startswith(b"[DONE]") else orjson.loads(data)["choices"])
    return events


async def test_paced_stream_is_the_same_chunks_on_schedule() -> None:
    body = {"prompt": PROMPT, "max_tokens": TOKENS, "stream": True}
    async with run_lean(engine="vllm", role="decode") as plain:
        unpaced = await raw_exchange(plain.port, request(body))
    async with run_lean(engine="vllm", role="decode", ttft_s=TTFT_S, itl_s=ITL_S) as paced:
        started = time.monotonic()
        raw = await raw_exchange(paced.port, request(body))
        elapsed = time.monotonic() - started
    assert choices(raw) == choices(unpaced)
    assert len(dechunk(raw)) == TOKENS + 1  # a chunk per token, then [DONE]
    assert elapsed >= TTFT_S + (TOKENS - 1) * ITL_S - EARLY_S


async def test_paced_json_answer_takes_its_tokens_time() -> None:
    body = {"prompt": PROMPT, "max_tokens": TOKENS}
    async with run_lean(engine="sglang", role="decode", ttft_s=TTFT_S, itl_s=ITL_S) as paced:
        started = time.monotonic()
        raw = await raw_exchange(paced.port, request(body))
        elapsed = time.monotonic() - started
    assert raw.startswith(b"HTTP/1.1 200 OK\r\n")
    answer = orjson.loads(raw.partition(b"\r\n\r\n")[2])
    assert answer["usage"]["completion_tokens"] == TOKENS
    assert elapsed >= TTFT_S + (TOKENS - 1) * ITL_S - EARLY_S


async def test_client_reports_a_gap_per_token_pair_and_tallies_events() -> None:
    tally = EventTally()
    client = Client(timeout_s=10.0, tally=tally)
    body = orjson.dumps({"prompt": PROMPT, "max_tokens": TOKENS, "stream": True})
    try:
        async with run_lean(engine="vllm", role="decode", ttft_s=0.0, itl_s=ITL_S) as paced:
            origin = Origin("127.0.0.1", paced.port)
            timed = await client.request(origin, "POST", "/v1/completions", {}, body,
                                         count_events=True, time_events=True)
            untimed = await client.request(origin, "POST", "/v1/completions", {}, body,
                                           count_events=True)
    finally:
        await client.close()
    assert timed.events == TOKENS + 1 and timed.gaps is not None
    assert len(timed.gaps) == TOKENS - 1
    assert all(gap >= 0 for gap in timed.gaps)
    assert untimed.gaps is None
    assert tally.events == 2 * (TOKENS + 1)


async def test_bare_relay_forwards_byte_for_byte(tmp_path: Path) -> None:
    body = {"prompt": PROMPT, "max_tokens": TOKENS, "stream": True}
    async with run_lean(engine="vllm", role="decode") as engine:
        direct = await raw_exchange(engine.port, request(body))
        relay = await asyncio.to_thread(procs.start_relay, "relay", engine.port,
                                        log_dir=tmp_path)
        try:
            relayed = await raw_exchange(relay.port, request(body))
        finally:
            await asyncio.to_thread(procs.stop, relay)
    # Only the response ids differ (each request gets its own).
    assert choices(relayed) == choices(direct)
    assert relayed.partition(b"\r\n\r\n")[0] == direct.partition(b"\r\n\r\n")[0]


@pytest.mark.parametrize("flows", ["seq", "conc"])
def test_quick_paced_run_measures_every_way(tmp_path: Path, flows: str) -> None:
    out = tmp_path / "paced.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "bench.run", "--mode", "paced", "--quick", "--flows", flows,
         "--workers", "1,2", "--baseline-tree", str(REPO), "--modes", "direct,sidecar",
         "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180, check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    (rnd,) = result["flows"][flows]["rounds"]
    (row,) = rnd.values()
    assert list(row) == ["direct", "bare", "before", "sidecar", "sidecar-w2"]
    for way, side in row.items():
        assert side["errors"] == 0 and side["requests"] > 0 and side["tokens"] > 0, way
        # A loaded machine can read several paced tokens in one chunk, so the median gap
        # may be 0: measured, never negative; only the first token always takes time.
        assert side["itl_p50_ms"] >= 0 and side["ttft_p50_ms"] > 0
        if way != "direct":
            assert side["relay_cpu_us_per_token"] > 0
            assert side["relay_reads_per_token"] > 0 and side["relay_writes_per_token"] > 0
    assert "| sidecar-w2 |" in done.stdout and "relay CPU us/token" in done.stdout


def test_the_sidecar_prefix_wraps_every_sidecar_way_only(tmp_path: Path) -> None:
    # ``--sidecar-prefix`` (a profiler, callgrind) runs each sidecar under it: this tree's and
    # the baseline's, not the bare relay or the stubs.
    started = tmp_path / "started"
    wrapper = tmp_path / "wrap.sh"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {started}\nexec "$@"\n')
    wrapper.chmod(0o755)
    done = subprocess.run(
        [sys.executable, "-m", "bench.run", "--mode", "paced", "--quick", "--flows", "seq",
         "--baseline-tree", str(REPO), "--modes", "direct,sidecar", "--sidecar-prefix",
         str(wrapper), "--out", str(tmp_path / "paced.json")],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=180, check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = started.read_text().splitlines()
    assert len(lines) == 2 and all("bench.sidecar_proc" in line for line in lines), lines


def test_the_side_by_side_table_has_every_sidecar_way() -> None:
    # A run with only `--workers 2` has no way called `sidecar`: its `sidecar-w2` still gets
    # its column and its ratio to the router.
    def way(cpu: float, tokens: float, ttft: float) -> dict[str, float]:
        return {"relay_cpu_us_per_token": cpu, "tokens_per_s": tokens, "ttft_p50_ms": ttft}

    row = {"direct": {"tokens_per_s": 1000.0, "ttft_p50_ms": 50.0}, "smg": way(20.0, 990.0, 60.0),
           "sidecar-w2": way(30.0, 980.0, 55.0)}
    result = {"flows": {"conc": {"anchors": ["smg"], "ways": list(row),
                                 "rounds": [{256: row}]}}}
    table = paced.anchors_markdown(result)
    assert "| figure | direct | `smg` | sidecar-w2 | sidecar-w2 / smg |" in table
    assert "| relay CPU us per token | - | 20.00 | 30.00 | 1.50 |" in table
    assert "| TTFT p50 ms | 50.0 | 60.0 | 55.0 | 0.92 |" in table


def test_three_rounds_give_the_per_token_ratio_its_standard_error() -> None:
    """From three rounds on, the relay CPU per token's ratio to a router carries the error
    the rounds' spread leaves it; the other figures stay bare."""
    def row(sidecar_cpu: float, router_cpu: float) -> dict[str, dict[str, float]]:
        return {"direct": {"tokens_per_s": 1000.0, "ttft_p50_ms": 50.0},
                "vllm-router": {"relay_cpu_us_per_token": router_cpu, "tokens_per_s": 990.0,
                                "ttft_p50_ms": 60.0},
                "sidecar": {"relay_cpu_us_per_token": sidecar_cpu, "tokens_per_s": 980.0,
                            "ttft_p50_ms": 55.0}}

    rounds = [{256: row(side, router)} for side, router in ((60.0, 50.0), (66.0, 55.0),
                                                            (63.0, 60.0))]
    result = {"flows": {"seq": {"anchors": ["vllm-router"],
                                "ways": ["direct", "vllm-router", "sidecar"],
                                "rounds": rounds}}}
    table = paced.anchors_markdown(result)
    # Medians 63 and 55; standard errors sqrt(pi/2) * stdev / sqrt(3): 2.17 and 3.62.
    error = 63 / 55 * math.hypot(2.1708 / 63, 3.6181 / 55)
    assert f"| relay CPU us per token | - | 55.00 | 63.00 | 1.15 ± {error:.2f} |" in table
    assert "| TTFT p50 ms | 50.0 | 60.0 | 55.0 | 0.92 |" in table
    two_rounds = paced.anchors_markdown({"flows": {"seq": {**result["flows"]["seq"],
                                                         "rounds": rounds[:2]}}})
    per_token = [line for line in two_rounds if line.startswith("| relay CPU us per token")]
    assert len(per_token) == 1 and "±" not in per_token[0]
