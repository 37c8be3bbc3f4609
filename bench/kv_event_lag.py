"""How far the sidecar's index trails the engine on real vLLM (CPU), batch by batch, and how
its placements agree with what the engine held.

    flock /tmp/real-vllm.lock .venv/bin/python -m bench.kv_event_lag [--iterations 12]
        [--no-restart] [--out FILE]

Needs the real-vLLM engine environment (``bash tests/real_vllm/setup_env.sh``). Starts, with
the test suite's harness, a baseline engine, a NIXL prefill engine and the cache workload's
decode engine (tests/real_vllm/cache_workload.py: prefix caching, a 40-block KV cache, KV
events to the sidecar's bound TCP endpoint, and the measuring hook
tests/real_vllm/kv_event_timing_hook.py), one sidecar (``--kv-events-endpoint``,
``--local-prefill-max-uncached-tokens 96``, debug log), and runs the workload's two phases
(the decode engine killed and started again between them unless ``--no-restart``).

Each batch's path, in ms after the engine's stamp (``ts``, its ``time.time()`` at the end of
the step that made the batch), from the hook's lines and the sidecar's per-batch debug lines:

    removal -> stamp     the step: a block is evicted while the step is scheduled, the batch
                         is stamped when the step ends (batches that removed blocks)
    stamp -> sent        the engine's publisher thread takes the batch from its queue and
                         hands it to its ZMQ socket (... send returned: the three frames
                         handed over, pyzmq letting go of the GIL and taking it back for each)
    stamp -> received    ... through ZMQ to the sidecar's receive (the socket, its I/O
                         thread, the sidecar's event loop waking its reading task)
    stamp -> handled     ... decoded and applied to the index

And per request (the workload's records): where it ran, the cached tokens the sidecar found
against the engine's own count (requests run whole on the engine), requests run locally on a
belief the engine no longer held (its cached tokens below the prompt less the limit).

``--observer``: the engine binds an ``ipc://`` endpoint instead, the sidecar connects, and
so does an observer (a process that only receives, blocking, and notes when): the sidecar's
receive against the observer's is the sidecar's own share (its loop and its process), the
observer's against the engine's send the engine's ZMQ I/O thread and the socket.
``--unpin-zmq``: the engine's ZMQ I/O threads may run on every CPU (the hook's experiment):
what the engine's pinning to one core costs the events.

Deliberate limits: one run on the shared 2-core machine (other sessions' engines run too);
the stamps are compared across processes on one clock (``time.time()``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent.parent / "tests"
# The engines' harness lives with the real-vLLM suite; the benchmark starts them the same way.
sys.path.insert(0, str(TESTS))

from real_vllm.cache_workload import (  # noqa: E402
    BATCH_LINE,
    DECODE,
    MAX_UNCACHED,
    Record,
    Stack,
    Workload,
    decode_spec,
    rounds,
)
from real_vllm.harness import (  # noqa: E402
    ROUTE_FLAGS,
    EngineEnv,
    EngineGroup,
    EngineSpec,
    free_port,
    nixl_config,
)
from real_vllm.kv_event_timing_hook import UNPIN_ENV_VAR  # noqa: E402
from real_vllm.sidecar_process import sidecar_process  # noqa: E402


@dataclass(frozen=True)
class BatchLag:
    """One batch's path, in ms after the engine stamped it (None: not seen there)."""

    sequence: int
    #: The engine's stamp, as ``time.time()``.
    stamp_at: float | None
    removed: int  # blocks it removed
    sent_ms: float | None
    #: When the publisher's send returned.
    send_done_ms: float | None
    received_ms: float | None
    handled_ms: float | None
    #: The earliest removal in it, before the stamp (the engine's step).
    removal_to_stamp_ms: float | None


def lags(timing_log: Path, sidecar_log: Path) -> Iterator[BatchLag]:
    """Every batch of every engine start, matched by its stamp (unique per batch)."""
    sent: dict[str, tuple[int, float, float, int]] = {}
    removal_at: dict[str, float] = {}
    first_removal: dict[str, float] = {}
    for words in (line.split() for line in timing_log.read_text().splitlines()):
        if words[0] == "removed":
            for block in words[2:]:
                removal_at[block] = float(words[1])
        elif words[0] == "sent":
            stamp = words[3]
            blocks = words[6:]
            sent[stamp] = (int(words[2]), float(words[1]), float(words[5]), len(blocks))
            times = [removal_at[b] for b in blocks if b in removal_at]
            if times:
                first_removal[stamp] = min(times)
    seen: dict[str, tuple[float, float]] = {}
    for line in sidecar_log.read_text(errors="replace").splitlines():
        match = BATCH_LINE.search(line)
        if match is not None:
            seen[f"{float(match[2]):.6f}"] = (float(match[3]), float(match[4]))
    for stamp, (sequence, sent_at, done_at, removed) in sent.items():
        received, handled = seen.get(stamp, (None, None))
        removal = first_removal.get(stamp)
        yield BatchLag(sequence, float(stamp), removed, (sent_at - float(stamp)) * 1000,
                       (done_at - float(stamp)) * 1000, received, handled,
                       None if removal is None else (float(stamp) - removal) * 1000)


def quantiles(values: list[float]) -> tuple[float, float, float]:
    """Median, p90 and max of ``values``."""
    ordered = sorted(values)
    if not ordered:
        return (float("nan"),) * 3
    return (ordered[len(ordered) // 2], ordered[min(len(ordered) - 1,
                                                    int(len(ordered) * 0.9))], ordered[-1])



_OBSERVER = """
import sys, time, msgspec, zmq
context = zmq.Context()
sub = context.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"kv")
sub.connect(sys.argv[1])
with open(sys.argv[2], "a", buffering=1) as out:
    while True:
        topic, sequence, payload = sub.recv_multipart()
        now = time.time()
        out.write(f"{now:.6f} {msgspec.msgpack.decode(payload)[0]:.6f}\\n")
"""


def observed(path: Path) -> dict[str, float]:
    """The observer's receive time of each batch, by the batch's stamp."""
    seen: dict[str, float] = {}
    for line in path.read_text().splitlines() if path.exists() else ():
        at, stamp = line.split()
        seen[stamp] = float(at)
    return seen


def lag_table(timing_log: Path, sidecar_log: Path, observer_log: Path | None = None,
              ) -> tuple[str, dict[str, Any]]:
    batches = list(lags(timing_log, sidecar_log))
    rows = {
        "removal -> stamp": [b.removal_to_stamp_ms for b in batches],
        "stamp -> sent": [b.sent_ms for b in batches],
        "stamp -> send returned": [b.send_done_ms for b in batches],
        "stamp -> received": [b.received_ms for b in batches],
        "stamp -> handled": [b.handled_ms for b in batches],
        "sent -> received": [None if b.received_ms is None or b.sent_ms is None
                             else b.received_ms - b.sent_ms for b in batches],
    }
    if observer_log is not None:
        seen = observed(observer_log)
        at = [(seen.get(f"{b.stamp_at:.6f}"), b) for b in batches if b.stamp_at is not None]
        rows["stamp -> observer received"] = [
            None if o is None else (o - b.stamp_at) * 1000 for o, b in at if b.stamp_at]
        rows["observer -> sidecar received"] = [
            None if o is None or b.received_ms is None or not b.stamp_at
            else b.received_ms - (o - b.stamp_at) * 1000 for o, b in at]
    lines = ["| segment (ms) | batches | median | p90 | max |", "|---|---|---|---|---|"]
    figures: dict[str, Any] = {"batches": len(batches),
                               "with_removals": sum(1 for b in batches if b.removed)}
    for name, values in rows.items():
        present = [v for v in values if v is not None]
        median, p90, top = quantiles(present)
        figures[name] = {"n": len(present), "median": median, "p90": p90, "max": top}
        lines.append(f"| {name} | {len(present)} | {median:.1f} | {p90:.1f} | {top:.1f} |")
    return "\n".join(lines), figures


_LOGGED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) DEBUG sidecar\.core\.placer: "
                     r"request (\S+): ")


def decision_staleness(timing_log: Path, sidecar_log: Path, observer_log: Path,
                       ) -> tuple[str, dict[str, Any]]:
    """At each placement decision: batches the engine had stamped that the sidecar had not
    applied, split into those already on this machine (the observer had them: the sidecar's
    share) and those not yet (the engine's and the socket's)."""
    seen = observed(observer_log)
    handled = {f"{b.stamp_at:.6f}": b.stamp_at + b.handled_ms / 1000
               for b in lags(timing_log, sidecar_log)
               if b.stamp_at is not None and b.handled_ms is not None}
    stamps = sorted(float(s) for s in handled)
    waiting_here: list[float] = []
    not_here: list[float] = []
    decisions = 0
    for line in sidecar_log.read_text(errors="replace").splitlines():
        match = _LOGGED.match(line)
        if match is None:
            continue
        decisions += 1
        # The log's clock is to the millisecond: the decision is within it.
        at = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        before, after = at - 0.001, at + 0.002
        for stamp in stamps:
            if stamp > before:
                break
            key = f"{stamp:.6f}"
            if handled[key] <= after:
                continue
            arrived = seen.get(key)
            if arrived is not None and arrived < before:
                waiting_here.append((at - arrived) * 1000)
            elif arrived is None or arrived > after:
                not_here.append((at - stamp) * 1000)
    here_q, away_q = quantiles(waiting_here), quantiles(not_here)
    text = (f"decisions {decisions}; batches on this machine but not yet applied at a "
            f"decision: {len(waiting_here)} (waiting median {here_q[0]:.1f} ms, max "
            f"{here_q[2]:.1f}); stamped but not yet here: {len(not_here)} (median "
            f"{away_q[0]:.1f} ms, max {away_q[2]:.1f})")
    return text, {"decisions": decisions, "waiting_here": len(waiting_here),
                  "waiting_here_ms": here_q, "not_here": len(not_here),
                  "not_here_ms": away_q}


def agreement(records: list[Record]) -> tuple[str, dict[str, Any]]:
    local = [r for r in records if r.outcome == "local_cached"]
    equal = sum(1 for r in local if r.sidecar_cached == r.engine_cached)
    fewer = sum(1 for r in local if (r.sidecar_cached or 0) < (r.engine_cached or 0))
    stale = [r for r in local
             if (r.engine_cached or 0) < r.prompt_tokens - MAX_UNCACHED]
    outputs = sum(1 for r in records if r.text == r.baseline_text)
    outcomes: dict[str, int] = {}
    for r in records:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    shared_alone = [r for r in records if r.request.kind == "shared" and r.alone]
    resident = [r for r in shared_alone
                if (r.decode_hits or 0) >= r.prompt_tokens - MAX_UNCACHED]
    resident_local = sum(1 for r in resident if r.outcome == "local_cached")
    figures = {
        "requests": len(records), "outcomes": outcomes, "outputs_equal": outputs,
        "local_cached": len(local), "sidecar_equals_engine": equal,
        "sidecar_below_engine": fewer, "stale_local": len(stale),
        "stale_shortfall_tokens": [r.prompt_tokens - MAX_UNCACHED - (r.engine_cached or 0)
                                   for r in stale],
        "shared_alone": len(shared_alone), "shared_alone_resident": len(resident),
        "shared_alone_resident_local": resident_local,
    }
    text = (f"requests {len(records)} ({outcomes}); outputs equal to the baseline's: "
            f"{outputs}; local_cached {len(local)}: sidecar's cached tokens = engine's in "
            f"{equal}, fewer in {fewer}; run locally on a stale belief: {len(stale)}; "
            f"shared users sent alone {len(shared_alone)}, the prefix resident for "
            f"{len(resident)}, of which run locally {resident_local}")
    return text, figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--no-restart", action="store_true")
    parser.add_argument("--observer", action="store_true",
                        help="an ipc endpoint the engine binds, and a second subscriber")
    parser.add_argument("--unpin-zmq", action="store_true",
                        help="the engine's ZMQ I/O threads on every CPU (an experiment)")
    parser.add_argument("--out", type=Path, default=None, help="JSON figures")
    args = parser.parse_args()
    env = EngineEnv.locate()
    work = Path(tempfile.mkdtemp(prefix="kv-event-lag-"))
    endpoint = f"ipc://{work}/kv-events.sock" if args.observer else \
        f"tcp://127.0.0.1:{free_port()}"
    more_env = {UNPIN_ENV_VAR: "1"} if args.unpin_zmq else {}
    observer_log = work / "observer.log" if args.observer else None
    with contextlib.ExitStack() as held, EngineGroup(env) as group:
        started = group.start([
            EngineSpec("lag-baseline", None, cpu=0, extra_args=ROUTE_FLAGS),
            EngineSpec("lag-prefill", nixl_config("kv_producer"), cpu=0,
                       extra_args=ROUTE_FLAGS),
        ])
        group.spawn(decode_spec(endpoint, work, **more_env))
        decode = group.engines[DECODE]
        if observer_log is not None:
            observer = subprocess.Popen([sys.executable, "-c", _OBSERVER, endpoint,
                                         str(observer_log)])
            held.callback(observer.wait)
            held.callback(observer.kill)
        for _ in sidecar_process(
            work, "--engine", "vllm", "--kv-connector", "shfs", "--engine-url", decode.url,
            "--kv-events-endpoint", endpoint, "--kv-events-topic", "kv",
            "--local-prefill-max-uncached-tokens", str(MAX_UNCACHED), "--log-level", "debug",
        ):
            group.wait_ready([DECODE])
            ports = json.loads((work / "ports.json").read_text())
            stack = Stack(f"http://127.0.0.1:{ports['http']}", work / "sidecar.log",
                          decode.url, started["lag-baseline"].url,
                          f"127.0.0.1:{started['lag-prefill'].port}", work / "timing.log")
            workload = Workload(stack)
            workload.run(1, rounds(workload, 1, args.iterations))
            if not args.no_restart:
                group.restart(DECODE, kill=True)
                stack.decode_url = group.engines[DECODE].url
            workload.run(2, rounds(workload, 2, args.iterations))
            table, lag_figures = lag_table(stack.timing_log, stack.sidecar_log, observer_log)
            text, agree = agreement(workload.records)
            print(table)
            print(text)
            results: dict[str, Any] = {"lag": lag_figures, "agreement": agree}
            if observer_log is not None:
                stale_text, results["at_decisions"] = decision_staleness(
                    stack.timing_log, stack.sidecar_log, observer_log)
                print(stale_text)
            if args.out is not None:
                args.out.write_text(json.dumps(results, indent=2))
            print(f"logs: {work}", file=sys.stderr)


if __name__ == "__main__":
    main()
