"""The anchors' plumbing: the compiled routers (smg, vllm-router) as bench modes.

Proves, without the wheels: the command lines bind loopback only and name one prefill
(smg: with its bootstrap port) and one decode; an anchor is unavailable on the other
flow's stubs and where it is not installed, and a bench run then says so and skips it (exit
0, the other modes measured); the leg check passes a window of good PD requests only (one
prefill and one decode leg each, every hand-off remote); the thread meter neither loses a
thread started inside the window nor goes below zero when one ends; ``start_server`` waits
for readiness and fails clearly when the process dies. With a wheel installed (else
skipped, saying why): every flag the bench passes is in that version's ``--help``, and the
quick burst and paced runs measure the anchor next to direct and the sidecar, with its CPU,
its ratios in the table and its legs checked. Does not prove anything about speed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from bench import anchors, legs, procs
from bench.thread_meter import ThreadMeter

REPO = Path(__file__).resolve().parents[2]
FLOW_OF = {"smg": "conc", "vllm-router": "seq"}


def fake_proc(port: int, **info: Any) -> procs.Proc:
    return procs.Proc("stub", None, port, info)  # type: ignore[arg-type]


def flags(argv: list[str]) -> dict[str, list[str]]:
    """Each ``--flag`` with the values after it."""
    out: dict[str, list[str]] = {}
    current = ""
    for word in argv[1:]:
        if word.startswith("--"):
            current = word
            out[current] = []
        elif current:
            out[current].append(word)
    return out


def test_smg_command_line() -> None:
    prefill, decode = fake_proc(8100, bootstrap_port=8998), fake_proc(8200)
    argv = anchors.command("smg", "/x/smg", prefill, decode, 30001, 30002)
    assert argv[:3] == ["/x/smg", "launch", "--pd-disaggregation"]
    got = flags(argv)
    assert got["--prefill"] == ["http://127.0.0.1:8100", "8998"]
    assert got["--decode"] == ["http://127.0.0.1:8200"]
    assert got["--host"] == ["127.0.0.1"] and got["--prometheus-host"] == ["127.0.0.1"]
    assert got["--port"] == ["30001"] and got["--prometheus-port"] == ["30002"]
    assert got["--policy"] == ["random"] and got["--log-level"] == ["warn"]
    assert "--disable-load-monitoring" in got and "--disable-worker-overload-protection" in got
    with pytest.raises(ValueError, match="bootstrap"):
        anchors.command("smg", "/x/smg", fake_proc(8100), decode, 1, 2)


def test_vllm_router_command_line() -> None:
    argv = anchors.command("vllm-router", "/x/vr", fake_proc(8100), fake_proc(8200), 5, 6)
    got = flags(argv)
    assert argv[:2] == ["/x/vr", "--vllm-pd-disaggregation"]
    assert got["--prefill"] == ["http://127.0.0.1:8100"]  # no bootstrap port: NIXL
    assert got["--decode"] == ["http://127.0.0.1:8200"]
    assert got["--kv-connector"] == ["nixl"] and got["--policy"] == ["random"]
    assert got["--host"] == ["127.0.0.1"] and got["--prometheus-host"] == ["127.0.0.1"]
    assert got["--port"] == ["5"] and got["--prometheus-port"] == ["6"]
    assert got["--log-level"] == ["warning"]


def test_unavailable_on_the_wrong_stubs_and_when_not_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert "drives sglang/shfs" in str(anchors.unavailable("smg", "vllm", "shfs"))
    assert "drives vllm/shfs" in str(anchors.unavailable("vllm-router", "sglang", "shfs"))
    monkeypatch.setenv("BENCH_ANCHOR_PATH", str(tmp_path))
    for name, anchor in anchors.ANCHORS.items():
        assert anchors.find(name) is None
        why = anchors.unavailable(name, anchor.engine, anchor.connector)
        assert why is not None and "not installed" in why and "requirements-anchors" in why
    fake = tmp_path / "smg"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert anchors.find("smg") == str(fake)


def test_requirements_pin_both_anchors_exactly() -> None:
    lines = [line.split("#")[0].strip() for line in anchors.REQUIREMENTS.read_text().splitlines()]
    pins = dict(line.split("==") for line in lines if line)
    assert set(pins) == {a.package for a in anchors.ANCHORS.values()}
    assert all(version.strip() for version in pins.values())


def test_a_bench_run_without_the_anchor_skips_it(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "BENCH_ANCHOR_PATH": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "bench.run", "--quick", "--flows", "conc", "--phases",
         "json/c4", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=90, check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    flow = result["flows"]["conc"]
    assert flow["modes"] == ["direct", "sidecar"]
    assert set(flow["phases"]["json/c4"]) == {"direct", "sidecar"}
    assert "not installed" in result["anchors_skipped"]["smg"]["conc"]
    assert "drives vllm/shfs" in result["anchors_skipped"]["vllm-router"]["conc"]
    assert "smg: unavailable, skipped" in done.stderr
    assert "`smg`: skipped" in done.stdout


def counts(prefill: int | None, decode: int | None, **verdicts: int) -> legs.StubCounts:
    return legs.StubCounts(prefill, decode, verdicts)


def test_leg_check_passes_only_one_prefill_and_one_decode_with_remote_hand_offs() -> None:
    before = counts(10, 10, remote=10)
    assert legs.verdict(before, counts(15, 15, remote=15), 5)["ok"]
    assert not legs.verdict(before, counts(20, 15, remote=15), 5)["ok"]  # prefill twice
    assert not legs.verdict(before, counts(10, 15, remote=15), 5)["ok"]  # no prefill
    bad = legs.verdict(before, counts(15, 15, remote=14, recompute=1), 5)
    assert not bad["ok"] and bad["verdicts"] == {"recompute": 1, "remote": 4}
    assert "MISMATCH" in legs.brief(bad)
    # The aiohttp stubs count every request: only the verdicts are checked.
    assert legs.verdict(counts(None, None), counts(None, None, remote=3), 3)["ok"]
    assert not legs.verdict(counts(None, None), counts(None, None, remote=2), 3)["ok"]


def test_metrics_parse() -> None:
    text = ('# TYPE stub_requests_total counter\nstub_requests_total 7\n'
            'stub_handoff_total{outcome="remote",reason="ok"} 5\n'
            'stub_handoff_total{outcome="recompute",reason="bad_blocks"} 1\n'
            'stub_handoff_total{outcome="recompute",reason="missing"} 1\n')
    assert legs.parse_metrics(text) == (7, {"remote": 5, "recompute": 2})


def _burn(cpu_s: float) -> None:
    start = time.thread_time()
    while time.thread_time() - start < cpu_s:
        pass


def test_thread_meter_counts_a_new_thread_whole_and_an_ended_one_not_below_zero() -> None:
    meter = ThreadMeter({"me": os.getpid()})
    burned, release = threading.Event(), threading.Event()

    def burn_then_wait() -> None:
        _burn(0.05)
        burned.set()
        release.wait()

    # Born inside the window: all of its CPU is the window's.
    meter.start()
    thread = threading.Thread(target=burn_then_wait)
    thread.start()
    burned.wait()
    cpu = meter.stop()
    release.set()
    thread.join()
    assert cpu["me"] >= 0.05
    # Ran up its CPU before the window and ends inside it: summing the living threads at
    # both ends would give about -0.05 s here.
    burned.clear()
    release.clear()
    thread = threading.Thread(target=burn_then_wait)
    thread.start()
    burned.wait()
    meter.start()
    release.set()
    thread.join()
    cpu = meter.stop()
    assert 0 <= cpu["me"] < 0.05


def test_thread_meter_counts_what_ended_inside_the_window() -> None:
    # A reaped child is gone from /proc once wait() returns; a thread is not surely gone when
    # join() returns (CPython releases the join before the kernel drops the thread), so a
    # child shows the count without a race.
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    assert child.stdin is not None
    meter = ThreadMeter({"me": os.getpid()}, trees=frozenset({"me"}))
    meter.start()
    child.stdin.close()
    child.wait()
    meter.stop()
    assert meter.exited["me"] >= 1


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_start_server_waits_until_ready_and_fails_clearly(tmp_path: Path) -> None:
    proc = procs.start_server(
        "http", lambda port, _: [sys.executable, "-m", "http.server", "--bind", "127.0.0.1",
                                 str(port)],
        _listening, log_dir=tmp_path,
    )
    try:
        assert _listening(proc.port)
    finally:
        procs.stop(proc)
    assert proc.popen.poll() is not None
    with pytest.raises(RuntimeError, match="failed to get ready"):
        procs.start_server("dies", lambda port, _: [sys.executable, "-c", "raise SystemExit(3)"],
                           _listening, log_dir=tmp_path, timeout_s=5)


def installed(name: str) -> Any:
    return pytest.mark.skipif(anchors.find(name) is None,
                              reason=f"{name} not installed ({anchors.INSTALL_HINT})")


@pytest.mark.parametrize("name", [pytest.param(n, marks=installed(n)) for n in anchors.ANCHORS])
def test_every_flag_is_in_the_installed_help(name: str) -> None:
    executable = anchors.find(name)
    assert executable is not None
    help_argv = [executable, "launch", "--help"] if name == "smg" else [executable, "--help"]
    text = subprocess.run(help_argv, capture_output=True, text=True, timeout=60,
                          check=False).stdout
    argv = anchors.command(name, executable, fake_proc(1, bootstrap_port=2), fake_proc(3), 4, 5)
    for flag in flags(argv):
        assert f"{flag} " in text or f"{flag}\n" in text, flag


@pytest.mark.parametrize("name", [pytest.param(n, marks=installed(n)) for n in anchors.ANCHORS])
def test_quick_bench_measures_the_anchor(tmp_path: Path, name: str) -> None:
    flow_name = FLOW_OF[name]
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "bench.run", "--quick", "--flows", flow_name, "--modes",
         f"direct,sidecar,{name}", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    flow = result["flows"][flow_name]
    assert flow["modes"] == ["direct", "sidecar", name]
    assert flow["legs_ok"] == {"direct": True, "sidecar": True, name: True}
    for phase, sides in flow["phases"].items():
        side = sides[name]
        assert side["errors"] == 0 and side["requests"] > 0, phase
        assert side["relay"] == name and side["relay_cpu_us_per_req"] > 0, phase
    assert flow["phases"]["tokens"][name]["relay_cpu_us_per_token"] > 0
    assert result["anchors"][name]["version"] != "unknown"
    assert f"sidecar / {name}" in done.stdout


@pytest.mark.parametrize("name", [pytest.param(n, marks=installed(n)) for n in anchors.ANCHORS])
def test_quick_paced_run_measures_the_anchor(tmp_path: Path, name: str) -> None:
    flow_name = FLOW_OF[name]
    out = tmp_path / "paced.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "bench.run", "--mode", "paced", "--quick", "--flows", flow_name,
         "--modes", name, "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    flow = json.loads(out.read_text())["flows"][flow_name]
    (rnd,) = flow["rounds"]
    (row,) = rnd.values()
    assert list(row) == ["direct", "bare", name, "sidecar"]
    side = row[name]
    assert side["errors"] == 0 and side["tokens"] > 0 and side["legs"]["ok"]
    assert side["relay_cpu_us_per_token"] > 0
    assert f"sidecar / {name}" in done.stdout
