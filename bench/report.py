"""The benchmark's table (markdown) and its verdict on the performance targets.

    result dict (bench.run) ─markdown()─▶ tables: latency one at a time, load, token streams
                            ─targets()──▶ [{target, limit, measured, met}]

Deliberate limits: reads only the summaries ``bench.load.Phase.summary`` writes.
"""

from __future__ import annotations

from typing import Any

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


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"Command: `{result['command']}`  ",
        f"Machine: {m['cores']} cores ({m['cpu'] or 'unknown CPU'}), Python {m['python']}, "
        f"aiohttp {m['packages'].get('aiohttp', '?')}, uvloop {m['packages'].get('uvloop', '?')}; "
        f"{result['started']}  ",
        "Stubs, sidecar and load generator are separate processes sharing those cores.",
        "",
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
