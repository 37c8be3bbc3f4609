"""The benchmark's table (markdown) and its verdict on the performance targets.

    result dict (bench.run) ─markdown()─▶ tables: the anchors side by side, latency one at a
                                          time, load, token streams
                            ─targets()──▶ [{target, limit, measured, met}]

The anchors' table puts each compiled router (``bench.anchors``) next to direct and the
sidecar on the flow it drives (smg: SGLang, ``conc``; vllm-router: vLLM NIXL, ``seq``), with
the ratio sidecar / router: below 1 the sidecar spends less (CPU, added latency), above 1 it
serves more (requests/s).

Deliberate limits: reads only the summaries ``bench.load.Phase.summary`` writes.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from bench import machine_speed
from bench.anchors import ANCHORS

#: The issue's targets, evaluated on the vLLM NIXL flow (``seq``).
TARGETS: tuple[tuple[str, str, str, str, float, str], ...] = (
    # (name, phase, side, key, limit, "max" | "min")
    ("sidecar CPU per PD request, JSON, c32 (us)", "json/c32", "sidecar",
     "sidecar_cpu_us_per_req", 300.0, "max"),
    ("sidecar CPU per relayed token, 256-token streams (us)", "tokens", "sidecar",
     "sidecar_cpu_us_per_token", 2.0, "max"),
    ("streamed tokens/s through the sidecar / direct", "tokens", "ratio", "tokens_per_s",
     0.9, "min"),
    ("added latency one at a time, JSON, p50 (ms)", "json/serial", "added", "p50_ms", 0.5, "max"),
    ("added latency one at a time, JSON, p99 (ms)", "json/serial", "added", "p99_ms", 1.5, "max"),
    ("requests/s at c128, JSON", "json/c128", "sidecar", "rps", 3000.0, "min"),
)


def _value(phases: dict[str, Any], phase: str, side: str, key: str) -> float | None:
    sides = phases.get(phase)
    if not sides or "sidecar" not in sides:
        return None
    if side == "sidecar":
        value = sides["sidecar"].get(key)
        return float(value) if value is not None else None
    direct = sides.get("direct", {}).get(key)
    through = sides["sidecar"].get(key)
    if direct is None or through is None:
        return None
    if side == "ratio":
        return float(through) / float(direct) if direct else None
    return float(through) - float(direct)


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    phases = result.get("flows", {}).get("seq", {}).get("phases", {})
    out = []
    for name, phase, side, key, limit, kind in TARGETS:
        value = _value(phases, phase, side, key)
        met = None if value is None else (value <= limit if kind == "max" else value >= limit)
        out.append({"target": name, "limit": limit, "kind": kind,
                    "measured": None if value is None else round(value, 3), "met": met})
    return out


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _pair(sides: dict[str, Any], key: str, digits: int = 2) -> tuple[str, str, str]:
    direct = sides.get("direct", {}).get(key)
    through = sides.get("sidecar", {}).get(key)
    added = None
    if isinstance(direct, int | float) and isinstance(through, int | float):
        added = float(through) - float(direct)
    return _fmt(direct, digits), _fmt(through, digits), _fmt(added, digits)


def _cores(side: dict[str, Any]) -> str:
    cores = side.get("cpu_cores", {})
    order = ("sidecar", "prefill_stub", "decode_stub", "loadgen")
    return " / ".join(_fmt(cores.get(name)) for name in order)


def marginal_us_per_token(flow: dict[str, Any], plan: dict[str, Any]) -> float | None:
    """Sidecar CPU per extra token: long streams minus short streams at the same concurrency,
    per token of difference (the per-request cost cancels out)."""
    long = flow["phases"].get("tokens", {}).get("sidecar", {})
    short = flow["phases"].get(f"stream/c{plan['stream_concurrency']}", {}).get("sidecar", {})
    extra = int(plan["stream_tokens"]) - int(plan["short_tokens"])
    if "sidecar_cpu_us_per_req" not in long or "sidecar_cpu_us_per_req" not in short or extra <= 0:
        return None
    spent = float(long["sidecar_cpu_us_per_req"]) - float(short["sidecar_cpu_us_per_req"])
    return spent / extra


def _ratio(sidecar: float | None, anchor: float | None) -> float | None:
    if sidecar is None or anchor is None or anchor == 0:
        return None
    return sidecar / anchor


def _get(phases: dict[str, Any], phase: str, mode: str, key: str) -> float | None:
    value = phases.get(phase, {}).get(mode, {}).get(key)
    return float(value) if isinstance(value, int | float) else None


def median_error(figures: list[float]) -> float:
    """The standard error of the median of ``figures`` (a mode's windows, a way's rounds),
    their noise taken as normal and independent: sqrt(pi / 2) times the mean's (the
    median's efficiency). On the bench VM a c=32 window's CPU per request moves by about
    12 % from one window to the next (bench/README.md, How far a ratio holds), so five
    windows leave a median about 7 % either way and two modes' ratio about 10 %."""
    return math.sqrt(math.pi / 2) * statistics.stdev(figures) / math.sqrt(len(figures))


def relative_ratio_error(top: float, top_error: float, bottom: float,
                         bottom_error: float) -> float:
    """The standard error of ``top / bottom``: the relative errors added in quadrature."""
    return top / bottom * math.hypot(top_error / top, bottom_error / bottom)


#: One figure of the side-by-side table: (figure, direct, anchor, sidecar, digits, the
#: sidecar / anchor ratio's standard error or None).
AnchorRow = tuple[str, float | None, float | None, float | None, int, float | None]


def ratio_error(phases: dict[str, Any], phase: str, mode: str, anchor: str,
                key: str) -> float | None:
    """The standard error of ``mode`` / ``anchor`` in a phase of several windows (each
    median's, ``median_error``, carried into the ratio: the relative errors add in
    quadrature), or None where either ran one window."""
    sides = phases.get(phase, {})
    top, bottom = _get(phases, phase, mode, key), _get(phases, phase, anchor, key)
    top_error = sides.get(mode, {}).get("standard_error", {}).get(key)
    bottom_error = sides.get(anchor, {}).get("standard_error", {}).get(key)
    if not top or not bottom or top_error is None or bottom_error is None:
        return None
    return relative_ratio_error(top, top_error, bottom, bottom_error)


def anchor_rows(flow: dict[str, Any], anchor: str, plan: dict[str, Any]) -> list[AnchorRow]:
    """The side-by-side figures of one flow and one anchor."""
    phases = flow["phases"]
    low, high = min(plan["concurrencies"]), max(plan["concurrencies"])
    rows: list[AnchorRow] = []
    for label, phase, key in (
        (f"CPU us per PD request, JSON, c={low}", f"json/c{low}", "relay_cpu_us_per_req"),
        ("CPU us per PD request, JSON, one at a time", "json/serial", "relay_cpu_us_per_req"),
    ):
        rows.append((label, None, _get(phases, phase, anchor, key),
                     _get(phases, phase, "sidecar", key), 0,
                     ratio_error(phases, phase, "sidecar", anchor, key)))
    direct = _get(phases, "json/serial", "direct", "p50_ms")

    def added(mode: str) -> float | None:
        value = _get(phases, "json/serial", mode, "p50_ms")
        return None if value is None or direct is None else value - direct

    rows.append(("added p50 latency one at a time, JSON, ms (direct: its p50)", direct,
                 added(anchor), added("sidecar"), 3, None))
    rows.append((f"req/s, JSON, c={high}", _get(phases, f"json/c{high}", "direct", "rps"),
                 _get(phases, f"json/c{high}", anchor, "rps"),
                 _get(phases, f"json/c{high}", "sidecar", "rps"), 0, None))
    rows.append((f"burst CPU us per token ({plan['stream_tokens']}-token streams, "
                 f"c={plan['stream_concurrency']})", None,
                 _get(phases, "tokens", anchor, "relay_cpu_us_per_token"),
                 _get(phases, "tokens", "sidecar", "relay_cpu_us_per_token"), 2, None))
    return rows


def anchors_markdown(result: dict[str, Any]) -> list[str]:
    """The side-by-side table: per flow that ran an anchor, direct | anchor | sidecar |
    sidecar / anchor; then which anchors were skipped and the leg checks of every mode."""
    pairs = [(name, flow_name, flow) for flow_name, flow in result["flows"].items()
             for name in flow.get("modes", []) if name in ANCHORS]
    skipped = result.get("anchors_skipped", {})
    lines: list[str] = []
    if pairs:
        head = ["figure"]
        for name, flow_name, _ in pairs:
            head += [f"direct ({flow_name})", f"`{name}`", f"sidecar ({flow_name})",
                     f"sidecar / {name}"]
        lines += [
            "**The compiled routers side by side** (same run, same stubs; each router on the "
            "flow it drives; CPU of its whole process: every thread, every child; a ratio of "
            "several windows' medians ± its standard error):",
            "",
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
        ]
        tables = [anchor_rows(flow, name, result["plan"]) for name, _, flow in pairs]
        for index, (label, *_rest) in enumerate(tables[0]):
            cells = [label]
            for rows in tables:
                _, direct, anchor, sidecar, digits, error = rows[index]
                ratio = _fmt(_ratio(sidecar, anchor))
                cells += [_fmt(direct, digits), _fmt(anchor, digits), _fmt(sidecar, digits),
                          ratio if error is None or ratio == "-" else f"{ratio} ± {error:.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
        info = result.get("anchors", {})
        lines.append("")
        lines += [f"`{name}` {info.get(name, {}).get('version', '?')} "
                  f"({info.get(name, {}).get('style', '')}; threads "
                  f"{info.get(name, {}).get('threads_at_start', '?')}): "
                  f"`{info.get(name, {}).get('command', '')}`  " for name, _, _ in pairs]
    for name, flows in skipped.items():
        reasons = {why for why in flows.values() if "not installed" in why}
        if name not in {p[0] for p in pairs} and reasons:
            lines.append(f"`{name}`: skipped, {sorted(reasons)[0]}  ")
    checks = []
    for flow_name, flow in result["flows"].items():
        oks = flow.get("legs_ok", {})
        if oks:
            checks.append(f"{flow_name}: " + ", ".join(
                f"{mode} {'ok' if ok else '**MISMATCH**'}" for mode, ok in oks.items()))
    if checks:
        lines.append("One prefill and one decode leg per request, decode used the prefill's KV "
                     "(stub counters): " + "; ".join(checks))
    return [*lines, ""] if lines else []


def before_markdown(result: dict[str, Any]) -> list[str]:
    """With ``--baseline-tree``: each phase's CPU per request (and per token) of the sidecar
    from that tree (``before``) against this tree's, measured in the same run."""
    rows: list[str] = []
    for flow_name, flow in result["flows"].items():
        for phase, sides in flow["phases"].items():
            before, after = sides.get("before"), sides.get("sidecar")
            if before is None or after is None:
                continue
            b, a = before.get("relay_cpu_us_per_req"), after.get("relay_cpu_us_per_req")
            bt, at = before.get("relay_cpu_us_per_token"), after.get("relay_cpu_us_per_token")
            ratio = _fmt(_ratio(a, b))
            error = ratio_error(flow["phases"], phase, "sidecar", "before",
                                "relay_cpu_us_per_req")
            if error is not None and ratio != "-":
                ratio = f"{ratio} ± {error:.2f}"
            rows.append(f"| {flow_name} | {phase} | {_fmt(b, 0)} | {_fmt(a, 0)} | "
                        f"{ratio} | {_fmt(bt, 2)} | {_fmt(at, 2)} |")
    if not rows:
        return []
    return ["**Before and after** (`--baseline-tree`: the sidecar from that tree, `before`, "
            "and this tree's, each phase in turn in the same run; CPU of the sidecar process; "
            "a ratio of several windows' medians ± its standard error):",
            "", "| flow | phase | before CPU us/req | after CPU us/req | after / before "
            "| before us/token | after us/token |", "|---|---|---|---|---|---|---|", *rows, ""]


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"Command: `{result['command']}`  ",
        machine_speed.machine_line(result, ("aiohttp", "uvloop")),
        "Stubs, sidecar and load generator are separate processes sharing those cores.",
        "",
        *anchors_markdown(result),
        *before_markdown(result),
        "**One request at a time** (ms; TTFB = time to the first body byte):",
        "",
        "| flow | format | direct p50 | sidecar p50 | added p50 | direct p99 | sidecar p99 "
        "| added p99 | TTFB direct p50 | TTFB sidecar p50 | sidecar CPU us/req |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    flows = result["flows"]
    for flow_name, flow in flows.items():
        label = f"{flow_name} ({flow['engine']}/{flow['connector']})"
        for fmt in ("json", "stream"):
            sides = flow["phases"].get(f"{fmt}/serial")
            if not sides:
                continue
            d50, s50, a50 = _pair(sides, "p50_ms", 3)
            d99, s99, a99 = _pair(sides, "p99_ms", 3)
            t_d, t_s, _ = _pair(sides, "ttfb_p50_ms", 3)
            cpu = _fmt(sides.get("sidecar", {}).get("sidecar_cpu_us_per_req"), 0)
            lines.append(f"| {label} | {fmt} | {d50} | {s50} | {a50} | {d99} | {s99} | {a99} "
                         f"| {t_d} | {t_s} | {cpu} |")
    lines += [
        "",
        "**Under load** (closed loop; requests/s, latency in ms; CPU cores used by "
        "sidecar / prefill stub / decode stub / load generator):",
        "",
        "| flow | format | conc. | direct req/s | sidecar req/s | ratio | direct p50/p99 "
        "| sidecar p50/p99 | sidecar CPU us/req | cores, direct | cores, sidecar | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for flow_name, flow in flows.items():
        for key, sides in flow["phases"].items():
            if key.endswith("/serial") or key == "tokens":
                continue
            fmt, conc = key.split("/")
            d, s = sides.get("direct", {}), sides.get("sidecar", {})
            ratio = s.get("rps", 0) / d["rps"] if d.get("rps") else None
            errors = d.get("errors", 0) + s.get("errors", 0)
            lines.append(
                f"| {flow_name} | {fmt} | {conc[1:]} | {_fmt(d.get('rps'), 0)} "
                f"| {_fmt(s.get('rps'), 0)} | {_fmt(ratio)} "
                f"| {_fmt(d.get('p50_ms'))} / {_fmt(d.get('p99_ms'))} "
                f"| {_fmt(s.get('p50_ms'))} / {_fmt(s.get('p99_ms'))} "
                f"| {_fmt(s.get('sidecar_cpu_us_per_req'), 0)} | {_cores(d)} | {_cores(s)} "
                f"| {errors} |"
            )
    lines += [
        "",
        "**Token streams** (streamed answers, closed loop):",
        "",
        "| flow | tokens/stream | conc. | direct tokens/s | sidecar tokens/s | ratio "
        "| sidecar CPU us/token | marginal us/token | sidecar CPU us/req | cores, sidecar |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    plan = result["plan"]
    for flow_name, flow in flows.items():
        sides = flow["phases"].get("tokens")
        if not sides:
            continue
        d, s = sides.get("direct", {}), sides.get("sidecar", {})
        ratio = s.get("tokens_per_s", 0) / d["tokens_per_s"] if d.get("tokens_per_s") else None
        marginal = marginal_us_per_token(flow, plan)
        lines.append(
            f"| {flow_name} | {plan['stream_tokens']} | {plan['stream_concurrency']} "
            f"| {_fmt(d.get('tokens_per_s'), 0)} | {_fmt(s.get('tokens_per_s'), 0)} "
            f"| {_fmt(ratio)} | {_fmt(s.get('sidecar_cpu_us_per_token'), 3)} "
            f"| {_fmt(marginal, 3)} "
            f"| {_fmt(s.get('sidecar_cpu_us_per_req'), 0)} | {_cores(s)} |"
        )
    lines += ["", "**Targets** (vLLM NIXL flow; the per-token target is also shown as the "
              "marginal figure above):", "",
              "| target | limit | measured | met |", "|---|---|---|---|"]
    for t in result.get("targets", []):
        sign = "<=" if t["kind"] == "max" else ">="
        met = {True: "yes", False: "**no**", None: "-"}[t["met"]]
        lines.append(f"| {t['target']} | {sign} {t['limit']:g} | {_fmt(t['measured'])} | {met} |")
    handoffs = ", ".join(f"{name}: {flow.get('handoffs')}" for name, flow in flows.items())
    lines += ["", f"Decode stubs' hand-off verdicts (remote = used the prefill's KV): {handoffs}",
              ""]
    return "\n".join(lines)
