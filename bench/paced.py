"""The paced mode: tokens at an engine's cadence, many streams, the sidecar's cost per token.

    python -m bench.run --mode paced [--streams 256,1024] [--itl-ms 20] [--ttft-ms 50]
        [--tokens 64] [--seconds 4] [--rounds 2] [--baseline-tree DIR] [--workers 1,2]
        [--pin-sidecar 0 --pin-bench 1] [--short-tokens 16]

The stub engines (lean transport) space each stream's tokens ``--itl-ms`` apart after a
``--ttft-ms`` first-token delay (each stream on its own timer; the load generator staggers
the streams' starts over one interval, so tokens arrive spread out, not in lock-step), so
every token costs a relay its own read and write: the burst mode's 256 back-to-back tokens
share a read about 13 at a time. ``--streams`` workers each keep one stream of ``--tokens``
tokens open, in a closed loop, for each of these ways to the decode engine, in turn:

    direct      the load generator runs both legs itself (vLLM's proxy, SGLang's mini_lb)
    bare        as direct, the decode leg through ``bench.bare_relay`` (a uvloop forwarder):
                the floor of one read and one write per token in Python on this machine
    sidecar     through the sidecar (this tree; ``sidecar-wN`` with ``--workers N``)
    before      through a sidecar run from ``--baseline-tree`` (before/after, same run)
    smg         through SGLang's model gateway (Rust), SGLang flow, where installed
    vllm-router through vLLM's router (Rust), vLLM NIXL flow, where installed
                (``bench.anchors``; named in ``--modes``, the default)

Per way: tokens/s (counted as they arrive, inside the window), CPU per token of the process
that relays (sidecar, its workers included, or the bare relay), inter-token latency p50/p99
(gaps between one stream's token arrivals; events of one read share a stamp) and what it
adds to direct's, time to first token p50/p99, and the cores each process used; every
way's streams are checked to have run one prefill and one decode leg with a good hand-off
(``bench.legs``), and a relay's CPU is counted thread by thread with its children
(``bench.thread_meter``). A closing table puts the anchors beside direct, the bare relay
and the sidecar, with the ratios sidecar / router (medians over the rounds).
``--rounds`` repeats the ways interleaved, so the table shows how noisy the machine was.
``--short-tokens N`` runs every relaying way again with N-token streams, right after its
long-stream window, and splits its CPU into a cost per request and a marginal cost per token
(the two stream lengths' CPU per stream, solved for both).

Deliberate limits: a real engine's tokens of one batch leave at the same step; here each
stream ticks on its own, so a relay sees the tokens spread over the interval, as from many
engines or batches out of phase. Lean stubs only (vLLM NIXL and SGLang).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import anchors, flows, legs, load, machine_speed, procs, report
from bench.http_clients import Http, open_clients
from bench.lean_client import EventTally
from bench.thread_meter import ThreadMeter

#: Which process relays a way's tokens (whose CPU per token the table shows).
DIRECT, BARE, BEFORE = "direct", "bare", "before"


@dataclass(frozen=True)
class PacedPlan:
    streams: tuple[int, ...] = (256,)
    tokens: int = 64
    itl_ms: float = 20.0
    ttft_ms: float = 50.0
    seconds: float = 4.0
    rounds: int = 1
    workers: tuple[int, ...] = (1,)
    with_bare: bool = True
    short_tokens: int = 0  # also measure N-token streams: per-request vs per-token CPU

    def stream_s_of(self, tokens: int) -> float:
        return 2 * self.ttft_ms / 1e3 + (tokens - 1) * self.itl_ms / 1e3

    @property
    def stream_s(self) -> float:
        """One stream's duration at the stubs' pace (prefill and decode first tokens)."""
        return self.stream_s_of(self.tokens)


QUICK = PacedPlan(streams=(8,), tokens=4, itl_ms=5.0, ttft_ms=5.0, seconds=0.3)


@dataclass
class PacedStack:
    """One flow's processes: paced stubs, the bare relay, one or more sidecars."""

    flow: str
    engine: str
    prefill: procs.Proc
    decode: procs.Proc
    relays: dict[str, procs.Proc] = field(default_factory=dict)  # way -> relaying process
    anchors: list[str] = field(default_factory=list)  # the relays that are anchor routers
    skipped: dict[str, str] = field(default_factory=dict)  # anchor -> why it did not run

    def make(self, way: str, tokens: int) -> flows.Flow:
        if way in self.anchors:
            return flows.Router(way, self.relays[way].url, tokens, True)
        if way in (DIRECT, BARE):
            decode_url = self.relays[BARE].url if way == BARE else self.decode.url
            if self.engine == "vllm":
                flow: flows.Flow = flows.DirectSeq(self.prefill.url, decode_url, tokens, True)
            else:
                bootstrap = int(self.prefill.info["bootstrap_port"])
                flow = flows.DirectSGLang(self.prefill.url, decode_url, bootstrap, tokens, True)
            flow.name = way
            return flow
        return flows.Sidecar(self.relays[way].url, self.prefill.port, tokens, True)

    @property
    def pids(self) -> dict[str, int]:
        pids = {"prefill_stub": self.prefill.pid, "decode_stub": self.decode.pid}
        pids.update({way: procs.server_pid(proc) for way, proc in self.relays.items()})
        return pids


def ways_of(plan: PacedPlan, baseline: bool, anchor_ways: list[str] | None = None) -> list[str]:
    ways = [DIRECT]
    if plan.with_bare:
        ways.append(BARE)
    if baseline:
        ways.append(BEFORE)
    ways += anchor_ways or []
    ways += [sidecar_way(n) for n in plan.workers]
    return ways


def sidecar_way(workers: int) -> str:
    return "sidecar" if workers == 1 else f"sidecar-w{workers}"


@contextlib.contextmanager
def paced_stack(
    flow: str, plan: PacedPlan, log_dir: Path, *, max_connections: int,
    baseline_tree: Path | None, pin_sidecar: str, pin_bench: str,
    anchor_names: tuple[str, ...] = (), anchor_workers: int | None = None,
    worker_cores: dict[int, str] | None = None, sidecar_tree: Path | None = None,
    wrap: tuple[str, ...] = (), sidecar_python: str | None = None,
) -> Iterator[PacedStack]:
    """``worker_cores``: ``--pin-workers``' taskset CPU list per worker count (``bench.pinning``);
    otherwise every sidecar gets ``pin_sidecar``. ``wrap``: ``--sidecar-prefix``, the command
    each sidecar (this tree's and the baseline's, not the bare relay or the anchors) runs
    under, after its pinning (a profiler, callgrind). ``sidecar_python``: the interpreter
    every sidecar and the bare relay run on (``--sidecar-python``)."""
    engine = "vllm" if flow == "seq" else "sglang"
    bench_prefix = ["taskset", "-c", pin_bench] if pin_bench else []
    sidecar_prefix = ["taskset", "-c", pin_sidecar] if pin_sidecar else []
    shaping = ["--ttft", str(plan.ttft_ms / 1e3), "--itl", str(plan.itl_ms / 1e3)]
    started: list[procs.Proc] = []
    try:
        prefill = procs.start_stub(f"{flow}-prefill", engine, "prefill", "shfs", *shaping,
                                   log_dir=log_dir, prefix=bench_prefix)
        started.append(prefill)
        decode = procs.start_stub(f"{flow}-decode", engine, "decode", "shfs", *shaping,
                                  log_dir=log_dir, prefix=bench_prefix)
        started.append(decode)
        st = PacedStack(flow, engine, prefill, decode)
        if plan.with_bare:
            st.relays[BARE] = procs.start_relay(f"{flow}-bare", decode.port, log_dir=log_dir,
                                                prefix=sidecar_prefix, python=sidecar_python)
            started.append(st.relays[BARE])
        # Every stream is a request in flight and holds a decode connection (and a prefill
        # one while it prefills): the sidecar's limits must not be what the run measures.
        most = max(plan.streams)
        flags = [*procs.sidecar_flags(engine, "shfs", prefill, decode,
                                      max(max_connections, 2 * most)),
                 "--max-inflight", str(max(1024, 2 * most))]
        trees: list[tuple[str, Path, int]] = []
        if baseline_tree is not None:
            trees.append((BEFORE, baseline_tree, 1))
        trees += [(sidecar_way(n), sidecar_tree or procs.REPO_ROOT, n) for n in plan.workers]
        for way, tree, workers in trees:
            extra = ["--workers", str(workers)] if workers > 1 else []
            cores = (worker_cores or {}).get(workers)
            pinned = ["taskset", "-c", cores] if cores else sidecar_prefix
            proc = procs.start_sidecar(f"{flow}-{way}", [*flags, *extra], log_dir=log_dir,
                                       prefix=[*pinned, *wrap], code_root=tree,
                                       python=sidecar_python)
            started.append(proc)
            st.relays[way] = proc
        for name in anchor_names:
            why = anchors.unavailable(name, engine, "shfs")
            if why is not None:
                st.skipped[name] = why
                continue
            proc = anchors.start(name, prefill, decode, log_dir=log_dir, workers=anchor_workers,
                                 prefix=sidecar_prefix, label=f"{flow}-{name}")
            started.append(proc)
            st.relays[name] = proc
            st.anchors.append(name)
        yield st
    finally:
        for proc in reversed(started):
            procs.stop(proc)


@dataclass
class PacedPhase:
    """One way, one stream count: what the window saw."""

    tokens: int = 0
    requests: int = 0
    errors: int = 0
    wall_s: float = 0.0
    gaps: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)
    syscalls: tuple[int, int] = (0, 0)  # the relay's reads and writes in the window

    def summary(self, relay: str | None) -> dict[str, Any]:
        wall = self.wall_s or 1e-9
        out: dict[str, Any] = {
            "requests": self.requests, "errors": self.errors, "wall_s": round(self.wall_s, 3),
            "tokens": self.tokens, "tokens_per_s": round(self.tokens / wall, 1),
            "itl_p50_ms": _ms(load.percentile(self.gaps, 50)),
            "itl_p99_ms": _ms(load.percentile(self.gaps, 99)),
            "ttft_p50_ms": _ms(load.percentile(self.ttfts, 50)),
            "ttft_p99_ms": _ms(load.percentile(self.ttfts, 99)),
            "cpu_cores": {k: round(v / wall, 3) for k, v in self.cpu_s.items()},
        }
        if relay is not None and relay in self.cpu_s and self.tokens:
            out["relay_cpu_us_per_token"] = round(self.cpu_s[relay] / self.tokens * 1e6, 2)
            # About 1 each at an engine's cadence; well below 1 when the relay fell behind
            # and read several tokens at once (a starved machine), which also makes it
            # cheaper per token: read the CPU figure with this one.
            out["relay_reads_per_token"] = round(self.syscalls[0] / self.tokens, 3)
            out["relay_writes_per_token"] = round(self.syscalls[1] / self.tokens, 3)
        return out


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


async def paced_loop(
    flow: flows.Flow, streams: int, plan: PacedPlan, meter: load.CpuMeter,
    relay_pid: int | None = None, tokens: int | None = None,
) -> PacedPhase:
    """``streams`` workers, each looping on one stream; measured for ``plan.seconds`` once
    every worker has run a whole stream (the pools are full, the starts spread out)."""
    phase = PacedPhase()
    tally = EventTally()
    recording = False
    stopping = False
    interval = plan.itl_ms / 1e3
    stream_s = plan.stream_s_of(tokens or plan.tokens)

    warm = 0  # workers that have run a whole stream
    all_warm = asyncio.Event()

    async def worker(index: int, http: Http) -> None:
        nonlocal warm
        # Spread the starts over one interval: streams tick out of phase, as from many batches.
        await asyncio.sleep(interval * index / streams)
        first = True
        while not stopping:
            result = await load.safe_call(flow, http)
            if first:
                first = False
                warm += 1
                if warm == streams:
                    all_warm.set()
            if not recording:
                continue
            if not result.ok:
                phase.errors += 1
                continue
            phase.requests += 1
            phase.ttfts.append(result.first_byte_s)
            if result.gaps:
                phase.gaps.extend(result.gaps)

    async with open_clients("lean", streams, time_events=True, tally=tally) as new_http:
        tasks = [asyncio.ensure_future(worker(i, new_http())) for i in range(streams)]
        try:
            await asyncio.sleep(interval + stream_s * 1.5 + 0.2)
            # A first connect whose SYN a full listen queue dropped is retried after 1 s: its
            # worker's first stream (TTFT over a second) must end before the window opens.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(all_warm.wait(), 30 + stream_s * 2)
            meter.start()
            calls0 = procs.tree_syscalls(relay_pid) if relay_pid else (0, 0)
            events0 = tally.events
            started = time.perf_counter()
            recording = True
            await asyncio.sleep(plan.seconds)
            recording = False
            phase.wall_s = time.perf_counter() - started
            phase.cpu_s = meter.stop()
            if relay_pid:
                calls1 = procs.tree_syscalls(relay_pid)
                phase.syscalls = (calls1[0] - calls0[0], calls1[1] - calls0[1])
            # Every finished stream's [DONE] is an event, not a token.
            phase.tokens = max(0, tally.events - events0 - phase.requests - phase.errors)
            stopping = True
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=60 + stream_s * 2)
        finally:
            for task in tasks:
                task.cancel()
    return phase


async def measure(st: PacedStack, plan: PacedPlan, ways: list[str],
                  log: Callable[[str], None]) -> dict[str, Any]:
    """Every way at every stream count, ``plan.rounds`` times interleaved."""
    trees = frozenset(w for w in ways if w.startswith("sidecar") or w in st.anchors)
    meter = ThreadMeter(st.pids, trees=trees)
    rounds: list[dict[str, Any]] = []

    async def counted_loop(way: str, tokens: int, streams: int,
                           relay_pid: int | None) -> tuple[PacedPhase, dict[str, Any]]:
        flow = flows.Counted(st.make(way, tokens))
        before = await legs.read(st.prefill.url, st.decode.url)
        phase = await paced_loop(flow, streams, plan, meter, relay_pid,
                                 None if tokens == plan.tokens else tokens)
        check = legs.verdict(before, await legs.read(st.prefill.url, st.decode.url),
                             flow.calls)
        if not check["ok"]:
            log(f"  {st.flow} paced {way}: legs {legs.brief(check)}")
        return phase, check

    for round_index in range(plan.rounds):
        this: dict[str, Any] = {}
        for streams in plan.streams:
            row: dict[str, Any] = {}
            for way in ways:
                relay_pid = st.pids.get(way) if way != DIRECT else None
                phase, check = await counted_loop(way, plan.tokens, streams, relay_pid)
                summary = phase.summary(None if way == DIRECT else way)
                summary["legs"] = check
                if meter.exited:
                    summary["threads_exited"] = dict(meter.exited)
                row[way] = summary
                if plan.short_tokens and relay_pid:
                    short, check = await counted_loop(way, plan.short_tokens, streams,
                                                      relay_pid)
                    summary["short"] = short.summary(way)
                    summary["short"]["legs"] = check
                    summary.update(split_cost(summary, summary["short"], plan.tokens,
                                              plan.short_tokens))
                log(f"  {st.flow} paced r{round_index + 1} s{streams} {way}: "
                    f"{summary['tokens_per_s']} tok/s, "
                    f"{summary.get('relay_cpu_us_per_token', '-')} us/token, "
                    f"{summary.get('relay_reads_per_token', '-')} reads/token, ITL p50/p99 "
                    f"{summary['itl_p50_ms']}/{summary['itl_p99_ms']} ms, TTFT p50 "
                    f"{summary['ttft_p50_ms']} ms, errors {summary['errors']}")
            this[str(streams)] = row
        rounds.append(this)
    return {"engine": st.engine, "ways": ways, "anchors": list(st.anchors), "rounds": rounds}


def legs_failed(flow: dict[str, Any]) -> int:
    """How many of a paced flow's windows failed the leg check."""
    failed = 0
    for rnd in flow["rounds"]:
        for row in rnd.values():
            for side in row.values():
                for summary in (side, side.get("short", {})):
                    failed += "legs" in summary and not summary["legs"]["ok"]
    return failed


def split_cost(long: dict[str, Any], short: dict[str, Any], n_long: int,
               n_short: int) -> dict[str, float]:
    """CPU per request and marginal CPU per token from two stream lengths' CPU per token:
    per stream = request + n * token, at both lengths."""
    if "relay_cpu_us_per_token" not in long or "relay_cpu_us_per_token" not in short:
        return {}
    per_stream_long = long["relay_cpu_us_per_token"] * n_long
    per_stream_short = short["relay_cpu_us_per_token"] * n_short
    marginal = (per_stream_long - per_stream_short) / (n_long - n_short)
    return {"marginal_us_per_token": round(marginal, 2),
            "per_request_us": round(per_stream_short - marginal * n_short, 1)}


def _median(values: list[float]) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


#: The paced side-by-side table's first figure.
CPU_PER_TOKEN = "relay CPU us per token"
#: Its key in a round's figures: the one whose ratios carry their standard error.
CPU_PER_TOKEN_KEY = "relay_cpu_us_per_token"


def anchors_markdown(result: dict[str, Any]) -> list[str]:
    """The anchors beside direct, the bare relay and the sidecar, per flow and stream count:
    relay CPU per token, tokens/s against direct's, TTFT p50 (medians over the rounds), and
    sidecar / router."""
    lines: list[str] = []
    for flow_name, flow in result["flows"].items():
        names = flow.get("anchors", [])
        if not names:
            continue
        ways = flow.get("ways", [])
        # Every sidecar way of the run (`sidecar`, `sidecar-w2`, ...) gets its column and ratios.
        sidecars = [w for w in ways if w.startswith("sidecar")]
        cols = [w for w in (DIRECT, BARE, *names) if w in ways] + sidecars
        ratios = [(side, name) for side in sidecars for name in names]
        head = ["figure", *[f"`{w}`" if w in names else w for w in cols],
                *[f"{side} / {name}" for side, name in ratios]]
        for streams in flow["rounds"][0]:
            rows = [row[streams] for row in flow["rounds"]]

            def med(way: str, key: str, rows: list[dict[str, Any]] = rows) -> float | None:
                values = [float(r[way][key]) for r in rows if key in r.get(way, {})]
                return _median(values)

            def error(way: str, key: str, rows: list[dict[str, Any]] = rows) -> float | None:
                """The standard error of ``way``'s median ``key``, from three rounds on."""
                values = [float(r[way][key]) for r in rows if key in r.get(way, {})]
                return report.median_error(values) if len(values) >= 3 else None

            def vs_direct(way: str, rows: list[dict[str, Any]] = rows) -> float | None:
                return _median([r[way]["tokens_per_s"] / r[DIRECT]["tokens_per_s"]
                                for r in rows if r.get(DIRECT, {}).get("tokens_per_s")])

            lines += [
                f"**{flow_name}, {streams} streams: the compiled routers side by side** "
                f"(medians of {len(rows)} round(s); relay CPU counts the whole process: "
                "every thread, every child; from three rounds on, its ratios ± their "
                "standard error):",
                "",
                "| " + " | ".join(head) + " |",
                "|" + "---|" * len(head),
            ]
            # Each row: its label, its figure per way, its digits, and the key of the rounds'
            # figure whose ratios carry their standard error (None: no ±).
            figures: tuple[tuple[str, Callable[[str], float | None], int, str | None], ...] = (
                (CPU_PER_TOKEN, lambda w: med(w, CPU_PER_TOKEN_KEY), 2, CPU_PER_TOKEN_KEY),
                ("tokens/s", lambda w: med(w, "tokens_per_s"), 0, None),
                ("tokens/s vs direct", vs_direct, 3, None),
                ("TTFT p50 ms", lambda w: med(w, "ttft_p50_ms"), 1, None),
            )
            for label, get, digits, spread_key in figures:
                values = {w: get(w) for w in cols}
                cells = [label, *[_fmt(values[w], digits) for w in cols]]
                for side_way, name in ratios:
                    side, anchor = values.get(side_way), values.get(name)
                    ratio = _fmt(side / anchor if side is not None and anchor else None, 2)
                    if spread_key is not None and side and anchor:
                        side_error = error(side_way, spread_key)
                        anchor_error = error(name, spread_key)
                        if side_error is not None and anchor_error is not None:
                            spread = report.relative_ratio_error(side, side_error, anchor,
                                                                 anchor_error)
                            ratio += f" ± {spread:.2f}"
                    cells.append(ratio)
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
    info = result.get("anchors", {})
    lines += [f"`{name}` {a.get('version', '?')} (threads {a.get('threads_at_start', '?')}): "
              f"`{a.get('command', '')}`  " for name, a in info.items()]
    for name, why in result.get("anchors_skipped", {}).items():
        reasons = sorted({w for w in why.values() if "not installed" in w})
        if reasons and name not in info:
            lines.append(f"`{name}`: skipped, {reasons[0]}  ")
    return [*lines, ""] if lines else []


def markdown(result: dict[str, Any]) -> str:
    """The paced table: one row per flow, round, stream count and way; then the anchors'."""
    plan = result["paced_plan"]
    lines = [
        f"Command: `{result['command']}`  ",
        machine_speed.machine_line(result, ("uvloop",)),
        f"Paced: {plan['tokens']} tokens per stream, {plan['itl_ms']:g} ms apart, first token "
        f"after {plan['ttft_ms']:g} ms (prefill and decode stubs each), {plan['seconds']:g} s "
        f"windows; pinned: sidecar/relay `{result.get('pin_sidecar') or '-'}`, stubs and load "
        f"`{result.get('pin_bench') or '-'}`.",
        "",
        "| flow | round | streams | way | tokens/s | vs direct | relay CPU us/token "
        "| relay reads / writes per token | marginal us/token, us/request "
        "| ITL p50 / p99 ms | added ITL p50 / p99 ms | TTFT p50 / p99 ms "
        "| cores: relay / prefill / decode / loadgen | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for flow_name, flow in result["flows"].items():
        for index, rnd in enumerate(flow["rounds"], 1):
            for streams, row in rnd.items():
                direct = row.get(DIRECT, {})
                for way, s in row.items():
                    ratio = (s["tokens_per_s"] / direct["tokens_per_s"]
                             if direct.get("tokens_per_s") else None)
                    added = "-"
                    if way != DIRECT and direct:
                        added = (f"{s['itl_p50_ms'] - direct['itl_p50_ms']:.2f} / "
                                 f"{s['itl_p99_ms'] - direct['itl_p99_ms']:.2f}")
                    cores = s["cpu_cores"]
                    relay = "-" if way == DIRECT else f"{cores.get(way, 0):.2f}"
                    used = " / ".join([relay] + [f"{cores.get(k, 0):.2f}" for k in
                                                 ("prefill_stub", "decode_stub", "loadgen")])
                    split = "-"
                    if "marginal_us_per_token" in s:
                        split = f"{s['marginal_us_per_token']:.1f}, {s['per_request_us']:.0f}"
                    calls = "-"
                    if way in flow.get("anchors", []):
                        calls = "n/c"  # see the note under the table
                    elif "relay_reads_per_token" in s:
                        calls = (f"{s['relay_reads_per_token']:.2f} / "
                                 f"{s['relay_writes_per_token']:.2f}")
                    lines.append(
                        f"| {flow_name} | {index} | {streams} | {way} | {s['tokens_per_s']:,.0f} "
                        f"| {'-' if ratio is None else f'{ratio:.2f}'} "
                        f"| {s.get('relay_cpu_us_per_token', '-')} | {calls} "
                        f"| {split} "
                        f"| {s['itl_p50_ms']:.2f} / {s['itl_p99_ms']:.2f} | {added} "
                        f"| {s['ttft_p50_ms']:.1f} / {s['ttft_p99_ms']:.1f} | {used} "
                        f"| {s['errors']} |"
                    )
    lines.append("")
    if any(flow.get("anchors") for flow in result["flows"].values()):
        lines += ["n/c: not comparable. The routers read sockets with recv(2), which "
                  "`/proc/<pid>/io` does not count, and their writes include the runtime's "
                  "wake-ups between threads (eventfd); the JSON keeps the raw counts.", ""]
    checks = []
    for flow_name, flow in result["flows"].items():
        failed = legs_failed(flow)
        checks.append(f"{flow_name}: {'ok' if not failed else f'**{failed} MISMATCHED**'}")
    lines.append("One prefill and one decode leg per stream, decode used the prefill's KV "
                 "(stub counters, every way and window): " + "; ".join(checks))
    lines.append("")
    lines += anchors_markdown(result)
    return "\n".join(lines) + "\n"
