"""Probes what real vLLM 0.32.0 (CPU build) does with data-parallel ranks (research for issue 22).

Run from the repository root, with the engine environment built (setup_env.sh):

    .venv/bin/python tests/real_vllm/probe_data_parallel.py [--phase NAME ...] [--out FILE]
        [--logs DIR] [--mooncake-decode-cpu N]

Phases (each starts its own engines, runs its checks, stops them; at most three engine
processes at once; about 12 minutes for all on an idle 2-core machine):
- ``internal``: one API server, ``--data-parallel-size 2`` (internal load balancing), no
  connector: which rank serves a request with ``X-data-parallel-rank: 0`` / ``1`` (the
  per-engine ``engine="N"`` counters of ``/metrics``), what an out-of-range or malformed
  header gets, where requests without the header go, and whether both ranks answer alike;
- ``nixl``: a DP 2 NixlConnector prefill and a DP 1 decode: the hand-off each prefill rank
  returns (engine id, side-channel port), greedy equality of decode against a plain
  engine for a request prefilled on each rank, and hand-offs edited to name the other rank;
- ``nixl_decode_dp2``: a DP 1 NIXL prefill and a DP 2 decode pinned by the header;
- ``mooncake``: a DP 2 MooncakeConnector prefill and a DP 1 decode: the bootstrap
  ``GET /query`` answer (recorded as ``tests/fixtures/vllm/0.32.0/mooncake_query_dp2.json``),
  the decode ``kv_transfer_params`` that work for a request prefilled on rank 1 (recorded as
  ``mooncake_completion_dp2_rank1.json``), and a decode naming the wrong rank's engine id;
- ``external``: the external-load-balancing shapes (``--data-parallel-rank`` per server,
  ``--data-parallel-multi-port-external-lb``) with the suite's dense model: the start-up error;
- ``cli``: the same through ``vllm serve`` (the CLI applies ``api_server_count`` = DP size
  and runs the multi-port supervisor; the API-server module does neither);
- ``external_moe``: a tiny Mixtral (build_moe_model.py) with one API server per rank: both
  start, the first request fails on CPU, and each rank server's Mooncake ``/query`` is
  recorded (``mooncake_query_dp2_external_lb.json``).

Prints one JSON object of evidence per phase and writes them all to ``--out``.

Deliberate limits: a probe, not a test (it asserts nothing; it records what happened); the
dense Llama serves (vLLM runs dense DP ranks as independent engines); MoE DP cannot serve a
request on this CPU build, so nothing here exercises MoE wave synchronisation; the
wrong-rank Mooncake case shortens ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`` to 60 s.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from real_vllm import harness
from real_vllm.client import (
    block_prompt,
    completion_body,
    decode_body,
    get_text,
    mooncake_decode_body,
    mooncake_prefill_body,
    prefill_body,
)
from real_vllm.harness import (
    VLLM_VERSION,
    EngineEnv,
    EngineGroup,
    EngineSpec,
    EngineStartError,
    free_port_run,
    mooncake_config,
    nixl_config,
)

FIXTURES_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / VLLM_VERSION
RANK_HEADER = "X-data-parallel-rank"
DP2_ARGS = ("--data-parallel-size", "2")
# One core per rank: the list is split by local DP rank (vllm/utils/ompmultiprocessing.py).
DP2_BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
PER_ENGINE = ("vllm:request_success_total", "vllm:prompt_tokens_total")
MOONCAKE_ENGINE_ID = "recorded-mooncake-prefill-dp2"
# vLLM's default is 480 s; the wrong-rank case waits for it. 15 s was measured too short on
# the loaded 2-core machine: a first transfer's request reached the prefill rank's sender
# after the prefill had already freed the blocks ("timed out after 15 seconds").
MOONCAKE_ABORT_TIMEOUT_S = 60
# The machine is shared: engines start in 30 s when idle, minutes under load.
START_DEADLINE_S = 600.0
# The Mooncake decode's core (``--mooncake-decode-cpu``); -1: not pinned. Pinned to the core
# of one prefill rank, the decode (polling while it waits for the push) starves that rank on
# this 2-core machine: its legs time out (measured, see dp-findings.md); unpinned, both work.
MOONCAKE_DECODE_CPU = -1
_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)")


def call(url: str, body: Mapping[str, Any] | None = None, headers: Mapping[str, str] | None = None,
         timeout: float = 120.0) -> tuple[int, str]:
    """POST ``body`` (GET without one); (status, text) whatever the status."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode(errors="replace")


def call_json(url: str, body: Mapping[str, Any], headers: Mapping[str, str] | None = None,
              timeout: float = 120.0) -> dict[str, Any]:
    status, text = call(url, body, headers, timeout)
    if status != 200:
        raise RuntimeError(f"{url}: HTTP {status}: {text[:400]}")
    reply: dict[str, Any] = json.loads(text)
    return reply


LOG_DIR: Path | None = None


def note(message: str) -> None:
    print(f"[probe {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def keep_logs(group: EngineGroup) -> None:
    """Copy the engines' logs out of the group's temp dir (removed when it closes)."""
    if LOG_DIR is None:
        return
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    for name, engine in group.engines.items():
        if engine.log_path.is_file():
            (LOG_DIR / f"{name}.log").write_bytes(engine.log_path.read_bytes())


@contextlib.contextmanager
def probe_group(env: EngineEnv) -> Iterator[EngineGroup]:
    """An engine group whose logs are kept (``--logs``) before its temp dir goes."""
    with EngineGroup(env) as group:
        try:
            yield group
        finally:
            keep_logs(group)


def rank_header(rank: int | None) -> dict[str, str]:
    return {} if rank is None else {RANK_HEADER: str(rank)}


def per_engine(url: str) -> dict[str, dict[str, float]]:
    """{metric: {engine label: value}} for the per-engine counters in PER_ENGINE."""
    out: dict[str, dict[str, float]] = {name: {} for name in PER_ENGINE}
    for line in get_text(url + "/metrics").splitlines():
        match = _SAMPLE.match(line)
        if match is None or match["name"] not in out:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match["labels"]))
        engine = labels.get("engine", "?")
        out[match["name"]][engine] = out[match["name"]].get(engine, 0.0) + float(match["value"])
    return out


def delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
          ) -> dict[str, dict[str, float]]:
    return {name: {e: after[name].get(e, 0.0) - before[name].get(e, 0.0)
                   for e in sorted(set(after[name]) | set(before[name]))}
            for name in after}


def measured(url: str, action: Callable[[], Any]) -> tuple[Any, dict[str, dict[str, float]]]:
    """Run ``action``; its result and how each engine's counters moved meanwhile."""
    before = per_engine(url)
    result = action()
    return result, delta(before, per_engine(url))


def text(reply: Mapping[str, Any]) -> str:
    return str(reply["choices"][0]["text"])


def metric_total(url: str, name: str) -> float:
    total = 0.0
    for line in get_text(url + "/metrics").splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def process_lines(log: str) -> dict[str, Any]:
    """Which vLLM processes the log shows (API servers, engine cores per DP rank)."""
    api = sorted(set(re.findall(r"\((APIServer(?:_\w+)?) pid=(\d+)\)", log)))
    cores = sorted(set(re.findall(r"\((EngineCore_DP\d+) pid=\d+\)", log)))
    keep = [line[:300] for line in log.splitlines()
            if re.search(r"api_server_count|Defaulting|DP Coordinator|engine_id to|"
                         r"Bootstrap Server started|Non-MoE|side channel|Engine ID", line)]
    return {"api_servers": [f"{n} pid={p}" for n, p in api], "engine_cores": cores,
            "log_lines": keep[:20]}


def phase_internal(env: EngineEnv) -> dict[str, Any]:
    spec = EngineSpec("dp2-plain", None, cpu=0, extra_args=DP2_ARGS, extra_env=DP2_BIND)
    with probe_group(env) as group:
        engine = group.start([spec], START_DEADLINE_S)["dp2-plain"]
        url = engine.url
        out: dict[str, Any] = {"argv_extra": list(DP2_ARGS), "env_extra": DP2_BIND,
                               "ready_after_s": round(engine.ready_after_s or 0, 1)}
        body = completion_body(block_prompt("dp probe internal"))
        texts: dict[str, str] = {}
        for rank in (0, 1, 1, 0):
            reply, moved = measured(url, partial(
                call_json, url + "/v1/completions", body, rank_header(rank)))
            texts.setdefault(str(rank), text(reply))
            out.setdefault("pinned", []).append({"header": rank, "moved": moved})
        out["same_text_on_both_ranks"] = texts["0"] == texts["1"]
        out["text"] = texts["0"]
        bad: dict[str, Any] = {}
        for value in ("2", "-1", "abc", "1.0", " 1"):
            (status, reply_text), moved = measured(url, partial(
                call, url + "/v1/completions", body, {RANK_HEADER: value}))
            bad[value] = {"status": status, "body": reply_text[:300],
                          "served_by": {e: n for e, n in
                                        moved["vllm:request_success_total"].items() if n}}
        out["bad_headers"] = bad
        status, chat = call(url + "/v1/chat/completions",
                            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 2}, {RANK_HEADER: "5"})
        out["chat_out_of_range"] = {"status": status, "body": chat[:300]}
        bodies = [completion_body(block_prompt(f"dp probe unpinned {i}")) for i in range(6)]

        def unpinned() -> list[str]:
            with ThreadPoolExecutor(max_workers=6) as pool:
                return list(pool.map(lambda b: text(call_json(url + "/v1/completions", b)),
                                     bodies))

        _, moved = measured(url, unpinned)
        out["unpinned_6_concurrent"] = moved
        out["processes"] = process_lines(engine.log_path.read_text(errors="replace"))
        out["load_endpoint"] = call(url + "/load")[1][:300]
        return out


def phase_nixl(env: EngineEnv) -> dict[str, Any]:
    side_base = free_port_run(2)
    prefill_spec = EngineSpec(
        "dp2-nixl-prefill", nixl_config("kv_producer"), cpu=0, extra_args=DP2_ARGS,
        extra_env={**DP2_BIND, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_base)})
    decode_spec = EngineSpec("nixl-decode", nixl_config("kv_consumer"), cpu=1,
                             prefix_caching=False)
    with probe_group(env) as group:
        engines = group.start([prefill_spec, decode_spec], START_DEADLINE_S)
        prefill, decode = engines["dp2-nixl-prefill"].url, engines["nixl-decode"].url
        out: dict[str, Any] = {"prefill_side_channel_base_port": side_base}
        handoffs: dict[str, dict[str, Any]] = {}
        note(f"nixl engines ready: prefill {prefill}, decode {decode}")
        for rank in (0, 1, None):
            note(f"nixl case prefill rank {rank}")
            body = completion_body(block_prompt(f"dp probe nixl rank {rank}"))
            expected = text(call_json(decode + "/v1/completions", body))
            pre, moved = measured(prefill, partial(
                call_json, prefill + "/v1/completions", prefill_body(body), rank_header(rank)))
            params = pre["kv_transfer_params"]
            hits_before = metric_total(decode, "vllm:external_prefix_cache_hits_total")
            got = text(call_json(decode + "/v1/completions", decode_body(body, pre)))
            hits = metric_total(decode, "vllm:external_prefix_cache_hits_total") - hits_before
            handoffs[str(rank)] = params
            out.setdefault("cases", []).append({
                "prefill_header": rank,
                "prefill_served_by": {e: n for e, n in
                                      moved["vllm:request_success_total"].items() if n},
                "kv_transfer_params": params,
                "decode_equals_plain_engine": got == expected,
                "decode_external_hits": hits,
            })
        # Rank 1's hand-off naming rank 0 (engine id and side-channel port, or the port
        # only): which field picks the rank the decode reads from?
        for case, fields in (("rank1_handoff_naming_rank0", ("remote_engine_id", "remote_port")),
                             ("rank1_handoff_with_rank0_port_only", ("remote_port",))):
            note(f"nixl case: {case}")
            body = completion_body(block_prompt(f"dp probe nixl {case}"))
            expected = text(call_json(decode + "/v1/completions", body))
            pre = call_json(prefill + "/v1/completions", prefill_body(body), rank_header(1))
            wrong = decode_body(body, pre)
            for field in fields:
                wrong["kv_transfer_params"][field] = handoffs["0"][field]
            started = time.monotonic()
            status, reply_text = call(decode + "/v1/completions", wrong, timeout=120)
            out[case] = {
                "replaced_with_rank0": list(fields), "status": status,
                "decode_equals_plain_engine": status == 200
                and text(json.loads(reply_text)) == expected,
                "body": reply_text[:200], "seconds": round(time.monotonic() - started, 1)}
        out["prefill_processes"] = process_lines(
            engines["dp2-nixl-prefill"].log_path.read_text(errors="replace"))
        return out


def phase_nixl_decode_dp2(env: EngineEnv) -> dict[str, Any]:
    """A DP 1 NIXL prefill and a DP 2 decode: the decode leg's rank is the header too."""
    prefill_spec = EngineSpec("nixl-prefill", nixl_config("kv_producer"), cpu=0)
    decode_spec = EngineSpec(
        "dp2-nixl-decode", nixl_config("kv_consumer"), cpu=1, prefix_caching=False,
        extra_args=DP2_ARGS,
        extra_env={**DP2_BIND, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port_run(2))})
    with probe_group(env) as group:
        engines = group.start([prefill_spec, decode_spec], START_DEADLINE_S)
        prefill, decode = engines["nixl-prefill"].url, engines["dp2-nixl-decode"].url
        cases = []
        for rank in (1, 0, None):
            note(f"nixl decode dp2: decode rank {rank}")
            body = completion_body(block_prompt(f"dp probe nixl decode rank {rank}"))
            expected = text(call_json(prefill + "/v1/completions", body))
            pre = call_json(prefill + "/v1/completions", prefill_body(body))
            reply, moved = measured(decode, partial(
                call_json, decode + "/v1/completions", decode_body(body, pre), rank_header(rank)))
            cases.append({
                "decode_header": rank,
                "decode_served_by": {e: n for e, n in
                                     moved["vllm:request_success_total"].items() if n},
                "decode_equals_plain_engine": text(reply) == expected})
        return {"cases": cases}


@dataclasses.dataclass(frozen=True)
class MooncakeExchange:
    """Both legs of one Mooncake request: the bodies sent and the (status, text) answers."""

    prefill_request: dict[str, Any]
    decode_request: dict[str, Any]
    prefill_answer: tuple[int, str]
    decode_answer: tuple[int, str]
    decode_seconds: float


def _mooncake_legs(prefill: str, decode: str, body: dict[str, Any], transfer_id: str,
                   bootstrap: str, engine_id: str, rank: int | None, timeout: float
                   ) -> MooncakeExchange:
    """Send both legs at once (the push flow); the prefill pinned to ``rank``."""
    pre_body = mooncake_prefill_body(body, transfer_id)
    dec_body = mooncake_decode_body(body, transfer_id, bootstrap, engine_id)
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=2) as pool:
        pre = pool.submit(call, prefill + "/v1/completions", pre_body, rank_header(rank), timeout)
        dec = pool.submit(call, decode + "/v1/completions", dec_body, None, timeout)
        decoded = dec.result()
        seconds = time.monotonic() - started
        return MooncakeExchange(pre_body, dec_body, pre.result(), decoded, seconds)


def phase_mooncake(env: EngineEnv) -> dict[str, Any]:
    if not env.mooncake_ready:
        return {"skipped": "Mooncake not set up (setup_env.sh)"}
    abort = {"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": str(MOONCAKE_ABORT_TIMEOUT_S),
             "VLLM_LOGGING_LEVEL": "DEBUG"}
    prefill_spec = EngineSpec(
        "dp2-mooncake-prefill", mooncake_config("kv_producer", MOONCAKE_ENGINE_ID), cpu=0,
        extra_args=DP2_ARGS, extra_env={**DP2_BIND, **abort})
    # A negative core: the decode is not pinned at all (its threads float over both cores).
    unpinned = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"} if MOONCAKE_DECODE_CPU < 0 else {}
    decode_spec = EngineSpec("mooncake-decode", mooncake_config("kv_consumer"),
                             cpu=max(MOONCAKE_DECODE_CPU, 0), prefix_caching=False,
                             extra_env={**abort, **unpinned})
    with probe_group(env) as group:
        engines = group.start([prefill_spec, decode_spec], START_DEADLINE_S)
        prefill_engine = engines["dp2-mooncake-prefill"]
        prefill, decode = prefill_engine.url, engines["mooncake-decode"].url
        bootstrap = f"http://127.0.0.1:{prefill_engine.mooncake_bootstrap_port}"
        answer = json.loads(get_text(bootstrap + "/query"))
        _write("mooncake_query_dp2", {
            "vllm_version": VLLM_VERSION,
            "connector": "MooncakeConnector",
            "endpoint": "GET /query",
            "data_parallel_size": 2,
            "prefill_engine_id": MOONCAKE_ENGINE_ID,
            "bootstrap_addr": bootstrap,
            "query_response": answer,
        })
        out: dict[str, Any] = {"query_response": answer, "decode_cpu": MOONCAKE_DECODE_CPU}
        recorded = False
        note(f"mooncake engines ready; /query: {answer}")
        for rank in (1, 0, 1, 0):
            note(f"mooncake case prefill rank {rank}")
            body = completion_body(block_prompt(f"dp probe mooncake rank {rank}"))
            expected = text(call_json(decode + "/v1/completions", body))
            engine_id = answer[str(rank)]["engine_id"]
            transfer_id = f"xfer-{uuid.uuid4().hex}"
            hits_before = metric_total(decode, "vllm:external_prefix_cache_hits_total")
            before = per_engine(prefill)
            exchange = _mooncake_legs(
                prefill, decode, body, transfer_id, bootstrap, engine_id, rank, 120)
            (status, reply_text), seconds = exchange.decode_answer, exchange.decode_seconds
            moved = delta(before, per_engine(prefill))
            hits = metric_total(decode, "vllm:external_prefix_cache_hits_total") - hits_before
            reply = json.loads(reply_text) if status == 200 else None
            out.setdefault("cases", []).append({
                "prefill_header": rank, "remote_engine_id": engine_id, "status": status,
                "prefill_served_by": {e: n for e, n in
                                      moved["vllm:request_success_total"].items() if n},
                "decode_equals_plain_engine": reply is not None and text(reply) == expected,
                "decode_external_hits": hits, "seconds": round(seconds, 2)})
            if rank == 1 and reply is not None and not recorded:
                recorded = True
                _write("mooncake_completion_dp2_rank1", {
                    "vllm_version": VLLM_VERSION,
                    "connector": "MooncakeConnector",
                    "endpoint": "/v1/completions",
                    "data_parallel_size": 2,
                    "client_request": body,
                    "transfer_id": transfer_id,
                    "prefill_headers": rank_header(rank),
                    "prefill_request": exchange.prefill_request,
                    "prefill_response": json.loads(exchange.prefill_answer[1]),
                    "decode_request": exchange.decode_request,
                    "decode_response": reply,
                    "decode_equals_connectorless_decode": text(reply) == expected,
                })
        note("mooncake case: prefill rank 1, decode names rank 0")
        # Prefilled on rank 1, decode names rank 0's engine: the KV is not where it asks.
        body = completion_body(block_prompt("dp probe mooncake wrong rank"))
        exchange = _mooncake_legs(
            prefill, decode, body, f"xfer-{uuid.uuid4().hex}", bootstrap,
            answer["0"]["engine_id"], 1, 3 * MOONCAKE_ABORT_TIMEOUT_S + 60)
        (status, reply_text), seconds = exchange.decode_answer, exchange.decode_seconds
        out["prefill_rank1_decode_names_rank0"] = {
            "status": status, "body": reply_text[:300], "seconds": round(seconds, 1),
            "abort_timeout_s": MOONCAKE_ABORT_TIMEOUT_S}
        out["prefill_processes"] = process_lines(
            prefill_engine.log_path.read_text(errors="replace"))
        return out


def phase_external(env: EngineEnv) -> dict[str, Any]:
    out: dict[str, Any] = {}
    shapes = {
        "external_lb_rank0": ("--data-parallel-size", "2", "--data-parallel-rank", "0"),
        "multi_port_external_lb": ("--data-parallel-size", "2", "--data-parallel-size-local",
                                   "2", "--data-parallel-multi-port-external-lb",
                                   "--data-parallel-supervisor-port", str(free_port_run(1))),
    }
    for name, args in shapes.items():
        with probe_group(env) as group:
            engine = group.spawn(EngineSpec(name, None, cpu=0, extra_args=args,
                                            extra_env=DP2_BIND))
            try:
                group.wait_ready(deadline_s=START_DEADLINE_S)
                out[name] = {"args": list(args), "started": True,
                             "ready_after_s": engine.ready_after_s}
            except EngineStartError:
                errors = [line for line in engine.log_tail(60).splitlines()
                          if "Error" in line or "error" in line]
                out[name] = {"args": list(args), "started": False,
                             "exit_code": engine.process.poll(), "errors": errors[-6:]}
    return out


_CLI_MAIN = (
    "import importlib.metadata as m, runpy, sys\n"
    "version = m.version\n"
    "m.version = lambda name: version('vllm-cpu' if name == 'vllm' else name)\n"
    "sys.argv[0] = 'vllm'\n"
    "runpy.run_module('vllm.entrypoints.cli.main', run_name='__main__')\n"
)


# With the version patched, the platform probe no longer sees a CPU build: name it.
CLI_ENV = {**DP2_BIND, "VLLM_TARGET_DEVICE": "cpu"}


@contextlib.contextmanager
def vllm_serve_cli() -> Iterator[None]:
    """Start engines through ``vllm serve`` (``vllm.entrypoints.cli.main``) instead of the
    API-server module: only the CLI applies the DP shapes' defaults (``api_server_count`` =
    DP size) and runs the multi-port supervisor (vllm/entrypoints/cli/serve.py 79-152)."""
    original = harness._engine_argv

    def cli_argv(env: EngineEnv, spec: EngineSpec, port: int) -> list[str]:
        argv = original(env, spec, port)
        module = argv.index("vllm.entrypoints.openai.api_server")
        # ``-c`` replaces ``-m MODULE``: the CLI asks for the "vllm" distribution's version,
        # which the CPU build installs as "vllm-cpu" (real-vllm-cpu.md, Install).
        return [*argv[:module - 1], "-c", _CLI_MAIN, "serve", *argv[module + 1:]]

    harness._engine_argv = cli_argv
    try:
        yield
    finally:
        harness._engine_argv = original


def phase_cli(env: EngineEnv) -> dict[str, Any]:
    """The same DP shapes started the way deployments start them, ``vllm serve``."""
    out: dict[str, Any] = {}
    with vllm_serve_cli():
        with probe_group(env) as group:
            engine = group.spawn(EngineSpec("cli-dp2-internal", None, cpu=0,
                                            extra_args=DP2_ARGS, extra_env=CLI_ENV))
            group.wait_ready(deadline_s=START_DEADLINE_S)
            url = engine.url
            body = completion_body(block_prompt("dp probe cli"))
            pinned = []
            for rank in (1, 1, 1, 0, 0, 0):
                _, moved = measured(url, partial(
                    call_json, url + "/v1/completions", body, rank_header(rank)))
                pinned.append({"header": rank, "served_by": {
                    e: n for e, n in moved["vllm:request_success_total"].items() if n}})
            out["internal_lb"] = {
                "ready_after_s": round(engine.ready_after_s or 0, 1), "pinned": pinned,
                "processes": process_lines(engine.log_path.read_text(errors="replace"))}
        with probe_group(env) as group:
            args = ("--data-parallel-size", "2", "--data-parallel-size-local", "2",
                    "--data-parallel-multi-port-external-lb",
                    "--data-parallel-supervisor-port", str(free_port_run(1)))
            engine = group.spawn(EngineSpec("cli-multi-port", None, cpu=0, extra_args=args,
                                            extra_env=CLI_ENV))
            try:
                group.wait_ready(deadline_s=START_DEADLINE_S)
                out["multi_port_external_lb"] = {"args": list(args), "started": True}
            except EngineStartError:
                errors = [line for line in engine.log_tail(80).splitlines()
                          if "Error" in line or "error" in line]
                out["multi_port_external_lb"] = {
                    "args": list(args), "started": False,
                    "exit_code": engine.process.poll(), "errors": errors[-6:]}
    return out


def moe_env(env: EngineEnv, root: Path) -> EngineEnv:
    """The engine environment serving a tiny Mixtral (build_moe_model.py) built under root."""
    out = root / "model-moe"
    subprocess.run([str(env.python), str(Path(__file__).with_name("build_moe_model.py")),
                    str(env.model_dir), str(out)], check=True, capture_output=True)
    return dataclasses.replace(env, model_dir=out)


def external_specs(prefix: str, rpc_port: int, kv: Mapping[str, Any] | None = None
                   ) -> list[EngineSpec]:
    """One API server per rank (external load balancing): ``--data-parallel-rank 0`` / ``1``."""
    common = ("--data-parallel-size", "2", "--data-parallel-address", "127.0.0.1",
              "--data-parallel-rpc-port", str(rpc_port))
    return [EngineSpec(f"{prefix}-r{rank}", kv, cpu=rank,
                       extra_args=(*common, "--data-parallel-rank", str(rank)))
            for rank in (0, 1)]


def phase_external_moe(env: EngineEnv) -> dict[str, Any]:
    """External load balancing with an MoE model: an API server (a port) per rank.

    Both servers start; the first forward pass of an MoE model with DP > 1 needs
    ``all_gatherv``, which the CPU communicator does not implement, so the probe records the
    first request's answer and the error, and for Mooncake only what start-up produces:
    each rank server's own bootstrap ``/query``.
    """
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="dp-probe-moe-") as tmp:
        moe = moe_env(env, Path(tmp))
        with probe_group(moe) as group:
            engines = group.start(external_specs("ext", free_port_run(1)), START_DEADLINE_S)
            body = completion_body(block_prompt("dp probe external"))
            per_rank: dict[str, Any] = {}
            for name, engine in engines.items():
                status, reply_text = call(engine.url + "/v1/completions", body)
                log = engine.log_path.read_text(errors="replace")
                per_rank[name] = {
                    "ready_after_s": round(engine.ready_after_s or 0, 1),
                    "first_request": {"status": status, "body": reply_text[:200]},
                    "errors": [line[line.find("]") + 1:].strip()[:200]
                               for line in log.splitlines()
                               if "NotImplementedError" in line or "all_gatherv" in line][:4],
                    "processes": process_lines(log)}
            out["plain"] = per_rank
        note("external moe: mooncake bootstrap per rank server")
        specs = external_specs("ext-mooncake-prefill", free_port_run(1),
                               mooncake_config("kv_producer", MOONCAKE_ENGINE_ID))
        with probe_group(moe) as group:
            engines = group.start(specs, START_DEADLINE_S)
            queries = {
                name: {"bootstrap_addr": f"http://127.0.0.1:{engine.mooncake_bootstrap_port}",
                       "query_response": json.loads(get_text(
                           f"http://127.0.0.1:{engine.mooncake_bootstrap_port}/query"))}
                for name, engine in engines.items()}
            out["mooncake_query_per_rank_server"] = queries
            _write("mooncake_query_dp2_external_lb", {
                "vllm_version": VLLM_VERSION,
                "connector": "MooncakeConnector",
                "endpoint": "GET /query",
                "data_parallel_size": 2,
                "shape": "external load balancing: one API server per rank "
                         "(--data-parallel-rank 0 / 1), each with its own bootstrap server",
                "model": "tiny Mixtral (build_moe_model.py)",
                "prefill_engine_id": MOONCAKE_ENGINE_ID,
                "per_rank_server": {name.rsplit("-", 1)[1]: entry
                                    for name, entry in queries.items()},
            })
    return out


def _write(stem: str, record: dict[str, Any]) -> None:
    FIXTURES_DIR.mkdir(parents=True, exist_ok=True)
    path = FIXTURES_DIR / f"{stem}.json"
    path.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {path}", file=sys.stderr)


PHASES = {"internal": phase_internal, "nixl": phase_nixl, "mooncake": phase_mooncake,
          "external": phase_external, "cli": phase_cli, "external_moe": phase_external_moe,
          "nixl_decode_dp2": phase_nixl_decode_dp2}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", action="append", choices=sorted(PHASES))
    parser.add_argument("--out", type=Path, help="write the evidence JSON here too")
    parser.add_argument("--logs", type=Path, help="copy each engine's log into this folder")
    parser.add_argument("--mooncake-decode-cpu", type=int, default=-1,
                        help="core of the Mooncake decode engine (prefill ranks: 0 and 1; "
                        "-1: not pinned)")
    args = parser.parse_args(argv)
    global LOG_DIR, MOONCAKE_DECODE_CPU
    LOG_DIR = args.logs
    MOONCAKE_DECODE_CPU = args.mooncake_decode_cpu
    env = EngineEnv.locate()
    results: dict[str, Any] = {}
    for name in args.phase or list(PHASES):
        started = time.monotonic()
        try:
            results[name] = PHASES[name](env)
        except Exception as exc:  # a probe records failures instead of stopping
            results[name] = {"failed": f"{type(exc).__name__}: {exc}"[:3000]}
        results[name]["phase_seconds"] = round(time.monotonic() - started, 1)
        print(json.dumps({name: results[name]}, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
