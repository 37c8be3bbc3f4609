"""The benchmark still runs: ``python -m bench.run --quick`` end to end, as CI would.

Proves: the stubs and the sidecar start as separate processes, every phase of both flows
(vLLM NIXL sequential, SGLang or vLLM Mooncake concurrent) completes without errors through
the sidecar and directly, the decode stubs used the prefill's hand-off, and the JSON and the
table carry the figures the docs show; by default with the lean stubs and load client,
and still with the aiohttp ones kept for comparison. Does not prove anything about speed:
the run is a few requests per phase on a shared machine.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import report
from bench.run import median_window, parse_args, plan_of

REPO = Path(__file__).resolve().parents[2]


def test_quick_run_produces_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "bench.run", "--quick", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=90, check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert set(result["flows"]) == {"seq", "conc"}
    for flow in result["flows"].values():
        assert flow["handoffs"].get("remote", 0) > 0
        assert set(flow.get("handoffs", {})) == {"remote"}
        for sides in flow["phases"].values():
            for mode in ("direct", "sidecar"):
                assert sides[mode]["errors"] == 0
                assert sides[mode]["requests"] > 0
            assert sides["sidecar"]["sidecar_cpu_us_per_req"] >= 0
    tokens = result["flows"]["seq"]["phases"]["tokens"]["sidecar"]
    assert tokens["tokens_per_s"] > 0
    assert [t["target"] for t in result["targets"]]
    assert "| flow |" in done.stdout and "Targets" in done.stdout


def test_quick_run_with_the_aiohttp_stubs_and_client(tmp_path: Path) -> None:
    """The comparison path (``--stubs aiohttp --client aiohttp``) still runs a PD flow."""
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "bench.run", "--quick", "--stubs", "aiohttp", "--client",
         "aiohttp", "--flows", "seq", "--phases", "json/c4,stream/serial", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=90, check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert (result["stubs"], result["client"]) == ("aiohttp", "aiohttp")
    flow = result["flows"]["seq"]
    assert set(flow["handoffs"]) == {"remote"}
    assert set(flow["phases"]) == {"json/c4", "stream/serial"}
    for sides in flow["phases"].values():
        assert all(side["errors"] == 0 and side["requests"] > 0 for side in sides.values())


def test_burst_rounds_report_the_median_window_and_every_round() -> None:
    """``--rounds N`` in burst mode: each closed-loop phase runs N windows per mode, and the
    window with the median CPU per request (requests/s for direct) stands for the mode, its
    figures whole, with every round's figure beside it."""
    assert plan_of(parse_args(["--rounds", "3"])).loop_rounds == 3
    assert plan_of(parse_args([])).loop_rounds == 1
    windows = [{"relay_cpu_us_per_req": cpu, "rps": rps}
               for cpu, rps in ((300.0, 1.0), (200.0, 2.0), (250.0, 3.0))]
    median = median_window(windows)
    assert (median["relay_cpu_us_per_req"], median["rps"]) == (250.0, 3.0)
    assert median["rounds"] == {"relay_cpu_us_per_req": [300.0, 200.0, 250.0]}
    # sqrt(pi / 2) * stdev / sqrt(n): stdev 50, three windows.
    assert median["standard_error"] == {"relay_cpu_us_per_req": 36.2}
    direct = median_window([{"rps": 5.0}, {"rps": 9.0}, {"rps": 7.0}])
    assert direct["rps"] == 7.0 and direct["rounds"] == {"rps": [5.0, 9.0, 7.0]}
    assert median_window([windows[0]]) is windows[0]
    assert "standard_error" not in median_window(windows[:2])


def test_a_ratio_of_several_windows_shows_its_standard_error() -> None:
    """The side-by-side and before/after tables write a ratio of medians with the error the
    windows' spread leaves it (relative errors in quadrature); a one-window ratio bare."""
    def side(cpu: float, error: float | None) -> dict[str, Any]:
        figures: dict[str, Any] = {"relay_cpu_us_per_req": cpu, "requests": 10, "errors": 0}
        if error is not None:
            figures["standard_error"] = {"relay_cpu_us_per_req": error}
        return figures

    phases = {"json/c32": {"sidecar": side(400.0, 12.0), "vllm-router": side(300.0, 9.0),
                           "before": side(400.0, 16.0)},
              "json/serial": {"sidecar": side(900.0, None), "vllm-router": side(600.0, None)}}
    error = report.ratio_error(phases, "json/c32", "sidecar", "vllm-router",
                               "relay_cpu_us_per_req")
    assert error == pytest.approx(400 / 300 * math.hypot(0.03, 0.03))
    assert report.ratio_error(phases, "json/serial", "sidecar", "vllm-router",
                              "relay_cpu_us_per_req") is None
    result = {"flows": {"seq": {"modes": ["sidecar", "before", "vllm-router"],
                                "phases": phases}},
              "plan": {"concurrencies": [32], "stream_tokens": 256, "stream_concurrency": 32}}
    side_by_side = "\n".join(report.anchors_markdown(result))
    assert "| CPU us per PD request, JSON, c=32 | - | 300 | 400 | 1.33 ± 0.06 |" in side_by_side
    assert "| CPU us per PD request, JSON, one at a time | - | 600 | 900 | 1.50 |" in side_by_side
    assert "| seq | json/c32 | 400 | 400 | 1.00 ± 0.05 |" in "\n".join(
        report.before_markdown(result))
