"""The benchmark: stub engines + the sidecar on loopback, direct versus through the sidecar.

    python -m bench.run                 # full run (~2-3 minutes), table + bench/results/*.json
    python -m bench.run --quick         # a few requests per phase (the CI smoke test)

For each flow (``seq``: vLLM NixlConnector, prefill then decode; ``conc``: SGLang, or vLLM
Mooncake where the SGLang stub is absent, both legs at once) it starts a prefill stub, a
decode stub and a sidecar in front of the decode stub, each its own process, then measures,
for JSON and streamed answers, direct (the load generator runs both legs itself, as vLLM's
reference proxy or SGLang's mini load balancer would) and through the sidecar:

    serial      one request at a time, direct and sidecar in turn (same machine state):
                p50/p99 latency, time to first byte (streams)
    c32, c128   closed loop at that concurrency: requests/s, p50/p99 latency
    tokens      256-token streams at concurrency 32: tokens/s

The anchors, the compiled PD routers (``bench.anchors``: ``smg``, SGLang's model gateway, on
the SGLang flow; ``vllm-router`` on the vLLM NIXL flow), run as two more modes next to direct
and the sidecar in the same run, where they are installed (``pip install -r
bench/requirements-anchors.txt``; otherwise the run says so and skips them). Every mode's
PD requests are checked to have run one prefill and one decode leg with a good hand-off
(``bench.legs``), and each relaying process's CPU is counted thread by thread, with its
children (``bench.thread_meter``).

That is the burst mode (``--mode burst``, the default: the stubs answer at once, so a relay
reads many tokens at a time). ``--mode paced`` spaces each stream's tokens like an engine
and measures many concurrent streams instead (``bench.paced``).

and the sidecar process's CPU (``/proc/<pid>/stat``) per request and per relayed token.
The load generator is this process; it shares the machine's cores with the stubs and the
sidecar, and the JSON records every process's CPU so a reader can see who used them.

The stubs run on the lean transport (``sidecar.tools.stubs --transport lean``) and the load
generator's client is the lean one (``bench.lean_client``) unless ``--stubs aiohttp`` /
``--client aiohttp`` ask for the aiohttp ones the bench used before (for comparison, and for
the vLLM Mooncake concurrent flow, which only the aiohttp transport serves).

Deliberate limits: loopback only, stubs in zero-latency mode (``--ttft 0 --itl 0``, no
request recording), so the figures are the software's cost, not an engine's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench import anchors, flows, http_clients, legs, load, machine_speed, paced, procs, report
from bench.pinning import plan_pinning as pinning_of
from bench.thread_meter import ThreadMeter

RESULTS_DIR = Path(__file__).resolve().parent / "results"
#: ``before``: a second sidecar from ``--baseline-tree`` (another commit), in the same run.
BEFORE = "before"
MODES = ("direct", "sidecar", BEFORE, *anchors.ANCHORS)


@dataclass(frozen=True)
class Plan:
    serial_n: int = 300
    loop_s: float = 3.0
    warmup_s: float = 0.5
    concurrencies: tuple[int, ...] = (32, 128)
    short_tokens: int = 16
    stream_tokens: int = 256
    stream_concurrency: int = 32
    serial_warmup: int = 30
    min_requests: int = 1
    #: Windows of each closed-loop phase per mode, the modes taking turns (``--rounds``).
    loop_rounds: int = 1


QUICK = Plan(serial_n=3, loop_s=0.2, warmup_s=0.05, concurrencies=(4,), short_tokens=4,
             stream_tokens=8, stream_concurrency=4, serial_warmup=1, min_requests=4)


@dataclass
class Stack:
    """The processes of one flow and how the load generator reaches them."""

    flow: str
    engine: str
    connector: str
    prefill: procs.Proc
    decode: procs.Proc
    sidecar: procs.Proc
    engine_id: str = ""
    stubs: str = "lean"
    anchors: dict[str, procs.Proc] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)  # anchor -> why
    before: procs.Proc | None = None  # the sidecar from --baseline-tree

    @property
    def pids(self) -> dict[str, int]:
        return {
            "sidecar": procs.server_pid(self.sidecar),
            **({BEFORE: procs.server_pid(self.before)} if self.before is not None else {}),
            "prefill_stub": self.prefill.pid,
            "decode_stub": self.decode.pid,
            **{name: proc.pid for name, proc in self.anchors.items()},
        }

    def make(self, mode: str, max_tokens: int, stream: bool) -> flows.Flow:
        if mode == "sidecar":
            return flows.Sidecar(self.sidecar.url, self.prefill.port, max_tokens, stream)
        if mode == BEFORE and self.before is not None:
            flow = flows.Sidecar(self.before.url, self.prefill.port, max_tokens, stream)
            flow.name = BEFORE
            return flow
        if mode in self.anchors:
            return flows.Router(mode, self.anchors[mode].url, max_tokens, stream)
        if self.flow == "seq":
            return flows.DirectSeq(self.prefill.url, self.decode.url, max_tokens, stream)
        bootstrap = int(self.prefill.info["bootstrap_port"])
        if self.engine == "sglang":
            return flows.DirectSGLang(
                self.prefill.url, self.decode.url, bootstrap, max_tokens, stream
            )
        return flows.DirectMooncake(
            self.prefill.url, self.decode.url, bootstrap, self.engine_id, max_tokens, stream
        )


def sglang_stub_available() -> bool:
    with contextlib.suppress(ImportError):
        return importlib.util.find_spec("sidecar.tools.stubs.sglang") is not None
    return False


def _flow_parts(flow: str, conc_engine: str) -> tuple[str, str]:
    if flow == "seq":
        return "vllm", "shfs"
    if conc_engine == "auto":
        conc_engine = "sglang" if sglang_stub_available() else "mooncake"
    return ("sglang", "shfs") if conc_engine == "sglang" else ("vllm", "mooncake")


@contextlib.contextmanager
def stack(flow: str, conc_engine: str, log_dir: Path, max_connections: int,
          sidecar_prefix: list[str], code_root: Path = procs.REPO_ROOT,
          stubs: str = "lean", modes: tuple[str, ...] = (),
          anchor_workers: int | None = None,
          baseline_tree: Path | None = None,
          sidecar_python: str | None = None) -> Iterator[Stack]:
    """One flow's stubs and sidecar, and the anchors named in ``modes`` that can run on it
    (the others land in ``Stack.skipped`` with the reason); ``sidecar_python``: the
    interpreter both sidecars run on (``--sidecar-python``)."""
    engine, connector = _flow_parts(flow, conc_engine)
    if stubs == "lean" and connector not in ("shfs",):
        raise SystemExit(f"the lean engine serves vLLM NIXL and SGLang, not {engine}/{connector}:"
                         " add --stubs aiohttp")
    started: list[procs.Proc] = []
    try:
        prefill = procs.start_stub(f"{flow}-prefill", engine, "prefill", connector,
                                   log_dir=log_dir, kind=stubs)
        started.append(prefill)
        decode = procs.start_stub(f"{flow}-decode", engine, "decode", connector,
                                  log_dir=log_dir, kind=stubs)
        started.append(decode)
        flags = procs.sidecar_flags(engine, connector, prefill, decode, max_connections)
        sidecar = procs.start_sidecar(f"{flow}-sidecar", flags, log_dir=log_dir,
                                      prefix=sidecar_prefix, code_root=code_root,
                                      python=sidecar_python)
        started.append(sidecar)
        st = Stack(flow, engine, connector, prefill, decode, sidecar, stubs=stubs)
        if baseline_tree is not None and BEFORE in modes:
            st.before = procs.start_sidecar(f"{flow}-before", flags, log_dir=log_dir,
                                            prefix=sidecar_prefix, code_root=baseline_tree,
                                            python=sidecar_python)
            started.append(st.before)
        for name in (m for m in modes if m in anchors.ANCHORS):
            why = anchors.unavailable(name, engine, connector)
            if why is not None:
                st.skipped[name] = why
                continue
            proc = anchors.start(name, prefill, decode, log_dir=log_dir,
                                 workers=anchor_workers, label=f"{flow}-{name}")
            started.append(proc)
            st.anchors[name] = proc
        yield st
    finally:
        for proc in reversed(started):
            procs.stop(proc)


async def _engine_id(bootstrap_port: int) -> str:
    """vLLM Mooncake: the prefill engine's id from its bootstrap server's ``/query``."""
    async with aiohttp.ClientSession(trust_env=False) as session:
        async with session.get(f"http://127.0.0.1:{bootstrap_port}/query") as response:
            data: dict[str, Any] = await response.json()
    for key, value in data.items():
        if isinstance(value, dict) and "engine_id" in value:
            return str(value["engine_id"])
        return str(key)
    raise RuntimeError("empty /query answer")


async def _handoff_counts(decode_url: str) -> dict[str, int]:
    """The decode stub's hand-off verdicts (remote = it used the prefill's KV)."""
    async with aiohttp.ClientSession(trust_env=False) as session:
        async with session.get(decode_url + "/metrics") as response:
            text = await response.text()
    return legs.parse_metrics(text)[1]


def relay_of(mode: str) -> str | None:
    """The process that relays a mode's requests (whose CPU the tables show)."""
    return None if mode == "direct" else mode


def relay_cost(phase: load.Phase, relay: str | None) -> dict[str, Any]:
    """The relaying process's CPU per request and per relayed token in ``phase``
    (``sidecar_cpu_us_per_req`` stays the sidecar's, whichever mode ran)."""
    if relay is None or relay not in phase.cpu_s:
        return {}
    cpu = phase.cpu_s[relay]
    out: dict[str, Any] = {
        "relay": relay, "relay_cpu_us_per_req": round(cpu / (phase.requests or 1) * 1e6, 1),
    }
    tokens = phase.events - phase.requests
    if tokens > 0:
        out["relay_cpu_us_per_token"] = round(cpu / tokens * 1e6, 3)
    return out


class _Legs:
    """Leg checks of one flow's phases: the stubs' counters around each window."""

    def __init__(self, st: Stack, log: Any) -> None:
        self.st = st
        self.log = log
        self.checks: list[dict[str, Any]] = []

    async def read(self) -> legs.StubCounts:
        return await legs.read(self.st.prefill.url, self.st.decode.url, self.st.stubs)

    async def record(self, phase: str, modes: list[str], before: legs.StubCounts,
                     calls: int) -> None:
        check = legs.verdict(before, await self.read(), calls)
        check.update(phase=phase, modes=modes)
        self.checks.append(check)
        if not check["ok"]:
            self.log(f"  {self.st.flow} {phase} {'+'.join(modes)}: legs {legs.brief(check)}")


async def measure_flow(
    st: Stack, plan: Plan, log: Any, only: set[str] | None = None,
    modes: tuple[str, ...] = MODES, client: str = "lean",
) -> dict[str, Any]:
    """Every phase of one flow (or those in ``only``), direct and through the sidecar."""

    def wanted(name: str) -> bool:
        return only is None or name in only

    if st.engine == "vllm" and st.connector == "mooncake":
        st.engine_id = await _engine_id(int(st.prefill.info["bootstrap_port"]))
    modes = tuple(m for m in modes if (m not in anchors.ANCHORS or m in st.anchors)
                  and (m != BEFORE or st.before is not None))
    meter = ThreadMeter(st.pids, trees=frozenset(st.anchors))
    out: dict[str, Any] = {
        "engine": st.engine, "connector": st.connector, "modes": list(modes), "phases": {},
    }
    phases: dict[str, Any] = out["phases"]
    checks = _Legs(st, log)

    def summarize(phase: load.Phase, mode: str, sidecar_name: str = "sidecar") -> dict[str, Any]:
        summary = phase.summary(sidecar_name)
        summary.update(relay_cost(phase, relay_of(mode)))
        if meter.exited:
            summary["threads_exited"] = dict(meter.exited)
        return summary

    async def window(name: str, mode: str, concurrency: int, tokens: int,
                     stream: bool) -> dict[str, Any]:
        flow = flows.Counted(st.make(mode, tokens, stream))
        before = await checks.read()
        phase = await load.closed_loop(flow, concurrency, plan.loop_s, meter,
                                       warmup_s=plan.warmup_s,
                                       min_requests=plan.min_requests, client=client)
        await checks.record(name, [mode], before, flow.calls)
        summary = summarize(phase, mode)
        log(f"  {st.flow} {name} {mode}: {_brief(summary)}")
        return summary

    async def loop(name: str, concurrency: int, tokens: int, stream: bool) -> None:
        # Each mode's windows alternate with the others' (the order rotated each round), so
        # a machine whose speed drifts over minutes weighs on every mode alike.
        windows: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
        for round_ in range(plan.loop_rounds):
            turn = round_ % len(modes)
            for mode in modes[turn:] + modes[:turn]:
                windows[mode].append(await window(name, mode, concurrency, tokens, stream))
        for mode, summaries in windows.items():
            phases.setdefault(name, {})[mode] = median_window(summaries)

    for fmt, stream in (("json", False), ("stream", True)):
        if wanted(f"{fmt}/serial"):
            counted = {mode: flows.Counted(st.make(mode, plan.short_tokens, stream))
                       for mode in modes}
            before = await checks.read()
            paired = await load.paired_serial(
                counted, plan.serial_n, meter, warmup=plan.serial_warmup, client=client,
            )
            await checks.record(f"{fmt}/serial", list(modes), before,
                                sum(flow.calls for flow in counted.values()))
            for mode, phase in paired.items():
                summary = summarize(phase, mode, "sidecar" if mode == "sidecar" else "-")
                phases.setdefault(f"{fmt}/serial", {})[mode] = summary
                log(f"  {st.flow} {fmt} serial {mode}: {_brief(summary)}")
        for concurrency in plan.concurrencies:
            if wanted(f"{fmt}/c{concurrency}"):
                await loop(f"{fmt}/c{concurrency}", concurrency, plan.short_tokens, stream)
    if wanted("tokens"):
        await loop("tokens", plan.stream_concurrency, plan.stream_tokens, True)
    out["handoffs"] = await _handoff_counts(st.decode.url)
    out["legs"] = checks.checks
    out["legs_ok"] = {mode: all(c["ok"] for c in checks.checks if mode in c["modes"])
                      for mode in modes}
    return out


def median_window(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """The window of one mode's rounds with the median CPU per request (requests/s for a
    mode without a relay), its figures whole; every round's figure under ``rounds`` and,
    from three rounds on, the median's standard error under ``standard_error``."""
    if len(summaries) == 1:
        return summaries[0]
    key = "relay_cpu_us_per_req" if "relay_cpu_us_per_req" in summaries[0] else "rps"
    ranked = sorted(summaries, key=lambda summary: summary[key])
    figures = [s[key] for s in summaries]
    out = {**ranked[(len(ranked) - 1) // 2], "rounds": {key: figures}}
    if len(figures) >= 3:
        out["standard_error"] = {key: round(report.median_error(figures), 1)}
    return out


def _brief(summary: dict[str, Any]) -> str:
    cpu = summary.get("relay_cpu_us_per_req", summary.get("sidecar_cpu_us_per_req", "-"))
    return (f"{summary['rps']} req/s p50 {summary['p50_ms']} ms p99 {summary['p99_ms']} ms "
            f"errors {summary['errors']} cpu/req {cpu} us")


def machine(sidecar_python: str | None = None) -> dict[str, Any]:
    """The machine's facts and speed; with ``sidecar_python``, the interpreter the sidecar
    runs on and its own loop step (``machine_speed.interpreter``)."""
    model = procs.cpu_model()
    versions = {}
    for name in ("aiohttp", "uvloop", "orjson", "httptools", "multidict", "yarl"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            versions[name] = version(name)
    return {
        "cores": os.cpu_count(),
        "cpu": model,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "packages": versions,
        "speed": machine_speed.speed(),
        **({"sidecar_python": machine_speed.interpreter(sidecar_python)}
           if sidecar_python else {}),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few requests per phase (smoke)")
    parser.add_argument("--flows", default="seq,conc", help="comma-separated: seq, conc")
    parser.add_argument("--conc-engine", choices=("auto", "sglang", "mooncake"), default="auto",
                        help="the concurrent flow's stubs (auto: SGLang when its stub exists)")
    parser.add_argument("--serial-n", type=int, help="requests per serial phase")
    parser.add_argument("--seconds", type=float, help="measured seconds per closed-loop phase")
    parser.add_argument("--concurrency", help="comma-separated closed-loop concurrencies")
    parser.add_argument("--stubs", choices=procs.STUBS, default="lean",
                        help="stub engines' transport (sidecar.tools.stubs): lean or aiohttp")
    parser.add_argument("--client", choices=http_clients.CLIENTS, default="lean",
                        help="the load generator's HTTP client: lean or aiohttp")
    parser.add_argument("--max-connections", type=int, default=1024,
                        help="the sidecar's upstream pool size (--max-connections)")
    parser.add_argument("--sidecar-prefix", default="",
                        help="command that wraps the sidecar, e.g. 'py-spy record -o x.svg --' "
                             "(paced: every sidecar way, after its pinning)")
    parser.add_argument("--sidecar-python",
                        help="the interpreter the sidecar runs on (and the paced mode's bare "
                             "relay): a Python built as the container image's is, optimized, "
                             "with the sidecar's dependencies installed (bench/README.md, "
                             "The sidecar's interpreter); default: this one")
    parser.add_argument("--phases", help="only these phases, e.g. json/c32,tokens (profiling)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated: direct, sidecar, and the anchors smg and "
                             "vllm-router where installed (profiling: sidecar); the paced "
                             "mode always runs direct and the sidecar, the anchors if named")
    parser.add_argument("--anchor-workers", type=int,
                        help="the anchors' tokio worker threads (TOKIO_WORKER_THREADS; "
                             "default: their own choice, one per core)")
    parser.add_argument("--sidecar-tree", type=Path,
                        help="run the sidecar package from this tree (e.g. `git archive` of an "
                             "older commit, or a tree built in place with its hot modules "
                             "compiled) instead of this one, in both modes")
    parser.add_argument("--mode", choices=("burst", "paced"), default="burst",
                        help="burst: zero-latency stubs (the phases above); paced: tokens at "
                             "an engine's cadence, many streams (bench.paced)")
    parser.add_argument("--streams", default="256",
                        help="paced: comma-separated concurrent stream counts")
    parser.add_argument("--tokens", type=int, default=64, help="paced: tokens per stream")
    parser.add_argument("--itl-ms", type=float, default=20.0,
                        help="paced: milliseconds between one stream's tokens")
    parser.add_argument("--ttft-ms", type=float, default=50.0,
                        help="paced: milliseconds before each stub's first token")
    parser.add_argument("--rounds", type=int, default=1,
                        help="paced: repeat every way this many times, interleaved; burst: "
                             "each closed-loop phase's windows, the modes taking turns "
                             "(the median window is reported)")
    parser.add_argument("--workers", default="1",
                        help="paced: comma-separated sidecar worker counts (serve --workers)")
    parser.add_argument("--short-tokens", type=int, default=0,
                        help="paced: also run N-token streams per relaying way, to split its "
                             "CPU into per request and per token")
    parser.add_argument("--no-bare", action="store_true",
                        help="paced: skip the bare uvloop relay (the floor)")
    parser.add_argument("--baseline-tree", type=Path,
                        help="also run a sidecar from this tree (`git archive` of the commit "
                             "before), as the mode (burst) or way (paced) `before`, in the "
                             "same run: each phase runs it right after this tree's sidecar")
    parser.add_argument("--pin-sidecar", default="",
                        help="paced: taskset CPU list for the sidecars and the bare relay")
    parser.add_argument("--pin-bench", default="",
                        help="paced: taskset CPU list for the stubs and the load generator")
    parser.add_argument("--pin-workers", action="store_true",
                        help="paced: each --workers N sidecar on N cores of its own, the stubs "
                        "and load on the other half (bench.pinning); counts that do not fit "
                        "are left out, with the reason")
    parser.add_argument("--out", type=Path, help="JSON output (default bench/results/<time>.json)")
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def plan_of(args: argparse.Namespace) -> Plan:
    base = QUICK if args.quick else Plan()
    changes: dict[str, Any] = {}
    if args.serial_n is not None:
        changes["serial_n"] = args.serial_n
    if args.seconds is not None:
        changes["loop_s"] = args.seconds
    if args.concurrency:
        changes["concurrencies"] = tuple(int(c) for c in args.concurrency.split(","))
    if args.rounds > 1:
        changes["loop_rounds"] = args.rounds
    return Plan(**{**base.__dict__, **changes})


def paced_plan_of(args: argparse.Namespace) -> paced.PacedPlan:
    workers = tuple(int(n) for n in args.workers.split(","))
    if args.quick:
        return dataclasses.replace(paced.QUICK, workers=workers, with_bare=not args.no_bare,
                                   short_tokens=min(args.short_tokens, 2))
    return paced.PacedPlan(
        streams=tuple(int(n) for n in args.streams.split(",")), tokens=args.tokens,
        itl_ms=args.itl_ms, ttft_ms=args.ttft_ms,
        seconds=args.seconds if args.seconds is not None else paced.PacedPlan.seconds,
        rounds=args.rounds, workers=workers, with_bare=not args.no_bare,
        short_tokens=args.short_tokens,
    )


async def run_paced(args: argparse.Namespace, result: dict[str, Any], log_dir: Path,
                    log: Callable[[str], None]) -> dict[str, Any]:
    plan = paced_plan_of(args)
    pin_sidecar, pin_bench = args.pin_sidecar, args.pin_bench
    worker_cores: dict[int, str] | None = None
    if args.pin_workers:
        if pin_sidecar or pin_bench:
            raise SystemExit("--pin-workers chooses the cores itself: "
                             "drop --pin-sidecar/--pin-bench")
        pinning = pinning_of(plan.workers)
        for count, why in pinning.left_out.items():
            log(f"--workers {count} left out of the pinned run: {why}")
        if not pinning.sidecars:
            raise SystemExit("--pin-workers: no worker count fits this machine's cores")
        plan = dataclasses.replace(plan, workers=tuple(pinning.sidecars))
        worker_cores = {n: pinning.cpu_list(cores) for n, cores in pinning.sidecars.items()}
        pin_sidecar, pin_bench = pinning.cpu_list(pinning.anchors), pinning.cpu_list(pinning.bench)
        left_out = {str(n): why for n, why in pinning.left_out.items()}
        result["pinned_workers"] = {"cores": worker_cores, "left_out": left_out}
    if pin_bench:
        os.sched_setaffinity(0, {int(c) for c in pin_bench.split(",")})
    result.update(paced_plan=plan.__dict__, pin_sidecar=pin_sidecar,
                  pin_bench=pin_bench, baseline_tree=str(args.baseline_tree or ""))
    anchor_names = tuple(m for m in modes_of(args) if m in anchors.ANCHORS)
    result["anchors"] = {}
    for flow in [f.strip() for f in args.flows.split(",") if f.strip()]:
        with paced.paced_stack(flow, plan, log_dir, max_connections=args.max_connections,
                               baseline_tree=args.baseline_tree, pin_sidecar=pin_sidecar,
                               pin_bench=pin_bench, anchor_names=anchor_names,
                               anchor_workers=args.anchor_workers,
                               worker_cores=worker_cores,
                               sidecar_tree=args.sidecar_tree,
                               wrap=tuple(args.sidecar_prefix.split()),
                               sidecar_python=args.sidecar_python) as st:
            log(f"{flow} (paced): {st.engine}  prefill {st.prefill.url}  decode {st.decode.url}")
            note_anchors(result, flow, {n: st.relays[n] for n in st.anchors}, st.skipped, log)
            ways = paced.ways_of(plan, args.baseline_tree is not None, st.anchors)
            result["flows"][flow] = await paced.measure(st, plan, ways, log)
            for name in st.anchors:
                result["anchors"][name]["threads_at_end"] = anchors.thread_count(
                    st.relays[name].pid)
    return result


async def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = plan_of(args)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    log_dir = (args.out.parent if args.out else RESULTS_DIR) / f"logs-{stamp}"
    log_dir.mkdir(parents=True, exist_ok=True)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    result: dict[str, Any] = {
        "command": " ".join(["python -m bench.run", *args.argv]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine(args.sidecar_python),
        "plan": plan.__dict__,
        "stubs": args.stubs,
        "client": args.client,
        "flows": {},
    }
    if args.mode == "paced":
        result["mode"] = "paced"
        return await run_paced(args, result, log_dir, log)
    prefix = args.sidecar_prefix.split() if args.sidecar_prefix else []
    modes = modes_of(args)
    result["anchors"] = {}
    for flow in [f.strip() for f in args.flows.split(",") if f.strip()]:
        with stack(flow, args.conc_engine, log_dir, args.max_connections, prefix,
                   args.sidecar_tree or procs.REPO_ROOT, args.stubs, modes,
                   args.anchor_workers, args.baseline_tree, args.sidecar_python) as st:
            log(f"{flow}: {st.engine}/{st.connector}  prefill {st.prefill.url}  "
                f"decode {st.decode.url}  sidecar {st.sidecar.url}"
                + "".join(f"  {name} {proc.url}" for name, proc in st.anchors.items()))
            note_anchors(result, flow, st.anchors, st.skipped, log)
            only = set(args.phases.split(",")) if args.phases else None
            result["flows"][flow] = await measure_flow(st, plan, log, only, modes, args.client)
            for name, proc in st.anchors.items():
                result["anchors"][name]["threads_at_end"] = anchors.thread_count(proc.pid)
    result["targets"] = report.targets(result)
    return result


def modes_of(args: argparse.Namespace) -> tuple[str, ...]:
    asked = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(asked) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown --modes {', '.join(sorted(unknown))}; known: "
                         f"{', '.join(MODES)}")
    return tuple(m for m in MODES if m in asked)


def note_anchors(result: dict[str, Any], flow: str, started: dict[str, procs.Proc],
                 skipped: dict[str, str], log: Callable[[str], None]) -> None:
    """What the JSON keeps of each anchor (version, command line, threads) and why one
    did not run on this flow; a missing install is said on the log too."""
    for name, proc in started.items():
        result["anchors"][name] = {"flow": flow, "style": anchors.ANCHORS[name].style,
                                   **proc.info}
        log(f"  {name} {proc.info['version']}: {proc.info['command']}")
    for name, why in skipped.items():
        result.setdefault("anchors_skipped", {}).setdefault(name, {})[flow] = why
        if "not installed" in why:
            log(f"  {name}: unavailable, skipped: {why}")


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop for the load generator too: it shares the cores, so it should cost little."""
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        result = runner.run(run(args))
    out = args.out or RESULTS_DIR / f"{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    table = paced.markdown(result) if args.mode == "paced" else report.markdown(result)
    print(table)
    if args.markdown:
        args.markdown.write_text(table)
    print(f"JSON: {out}", file=sys.stderr)
    if args.mode == "paced":
        errors = sum(
            side.get("errors", 0)
            for flow in result["flows"].values()
            for rnd in flow["rounds"]
            for row in rnd.values()
            for side in row.values()
        )
    else:
        errors = sum(
            side.get("errors", 0)
            for flow in result["flows"].values()
            for phase in flow["phases"].values()
            for side in phase.values()
        )
    # A request that did not run one prefill and one decode leg with a good hand-off.
    if args.mode == "paced":
        bad_legs = sum(paced.legs_failed(flow) for flow in result["flows"].values())
    else:
        bad_legs = sum(not check["ok"] for flow in result["flows"].values()
                       for check in flow.get("legs", []))
    if bad_legs:
        print(f"{bad_legs} leg checks failed: see 'legs' in {out}", file=sys.stderr)
    return 1 if errors or bad_legs else 0


if __name__ == "__main__":
    sys.exit(main())
