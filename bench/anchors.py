"""The comparison anchors: the compiled PD routers users would pick instead of the sidecar.

    smg           SGLang Model Gateway (Rust; PyPI ``smg``), PD mode, SGLang style: the same
                  body with bootstrap fields to both legs at once (the bench's ``conc`` flow)
    vllm-router   vLLM's router (Rust; PyPI ``vllm-router``), vLLM NIXL PD mode: prefill with
                  ``do_remote_decode``, then decode with the returned ``kv_transfer_params``
                  (the bench's ``seq`` flow)

    find(name)                         ─▶ the executable, or None (not installed)
    unavailable(name, engine, conn.)   ─▶ why the anchor cannot run on a flow, or None
    command(name, exe, prefill, decode, port, metrics_port) ─▶ its command line
    start(name, prefill, decode, ...)  ─▶ procs.Proc, once it served a PD request

They are bench tools, never a dependency of the sidecar: ``pip install -r
bench/requirements-anchors.txt`` puts the pinned wheels into the bench's environment; a
run without them says so and skips their modes. An executable is looked for next to the
running Python first (the bench's virtual environment), then on ``PATH``; where
``BENCH_ANCHOR_PATH`` is set, only there (e.g. a separate environment for the routers).

Command lines, read from the pinned versions' ``--help``: each listens on 127.0.0.1 (smg
binds every interface by default, its metrics listener too), picks workers at random (the
bench has one of each), logs warnings only (smg logs two lines per request at info level).
smg also gets ``--disable-load-monitoring`` and ``--disable-worker-overload-protection``:
its load polling and overload shedding need engine metrics a stub does not serve. Neither
accepts port 0, so ``procs.start_server`` hands them free ports. Both size their async
runtime (tokio) to the machine's cores; ``workers`` sets ``TOKIO_WORKER_THREADS`` to try
another size.

Deliberate limits: one prefill and one decode engine, completions only, the routers'
defaults otherwise (retries, circuit breaker, health checks every 60 s).
"""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Final

import orjson

from bench import procs

REQUIREMENTS: Final = Path(__file__).resolve().parent / "requirements-anchors.txt"
INSTALL_HINT: Final = "pip install -r bench/requirements-anchors.txt"


@dataclass(frozen=True)
class Anchor:
    """One router: its mode name, console script, PyPI package and the stubs it drives."""

    name: str
    executable: str
    package: str
    engine: str  # the stub engines it runs against ("sglang" or "vllm")
    connector: str  # and their connector ("shfs": vLLM NIXL, SGLang bootstrap)
    style: str  # for the table: how it runs the two legs


ANCHORS: Final = {
    "smg": Anchor("smg", "smg", "smg", "sglang", "shfs", "SGLang bootstrap, both legs at once"),
    "vllm-router": Anchor("vllm-router", "vllm-router", "vllm-router", "vllm", "shfs",
                          "vLLM NIXL, prefill then decode"),
}


def search_path() -> str:
    """Where executables are looked for: ``BENCH_ANCHOR_PATH`` where set, else this
    Python's directory (its virtual environment) and then ``PATH``."""
    override = os.environ.get("BENCH_ANCHOR_PATH")
    if override is not None:
        return override
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def find(name: str) -> str | None:
    """The anchor's executable, or None where it is not installed."""
    return shutil.which(ANCHORS[name].executable, path=search_path())


def unavailable(name: str, engine: str, connector: str) -> str | None:
    """Why ``name`` cannot run against these stubs (None: it can)."""
    anchor = ANCHORS[name]
    if (anchor.engine, anchor.connector) != (engine, connector):
        return f"drives {anchor.engine}/{anchor.connector} stubs, not {engine}/{connector}"
    if find(name) is None:
        return f"`{anchor.executable}` not installed ({INSTALL_HINT})"
    return None


def version(name: str, executable: str) -> str:
    """The installed version: the package's metadata where it lives in this environment,
    else what ``--version`` prints (smg has one; vllm-router has none)."""
    anchor = ANCHORS[name]
    with contextlib.suppress(metadata.PackageNotFoundError):
        if Path(executable).parent == Path(sys.executable).parent:
            return metadata.version(anchor.package)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run([executable, "--version"], capture_output=True, text=True,
                              timeout=30, check=False)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip().split()[-1]
    return "unknown"


def command(name: str, executable: str, prefill: procs.Proc, decode: procs.Proc, port: int,
            metrics_port: int) -> list[str]:
    """The anchor's command line in front of one prefill and one decode stub."""
    if name == "smg":
        bootstrap = prefill.info.get("bootstrap_port")
        if not bootstrap:
            raise ValueError("smg's SGLang PD mode needs the prefill's bootstrap port")
        return [
            executable, "launch", "--pd-disaggregation",
            "--prefill", prefill.url, str(bootstrap), "--decode", decode.url,
            "--host", "127.0.0.1", "--port", str(port), "--policy", "random",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--disable-load-monitoring", "--disable-worker-overload-protection",
            "--log-level", "warn",
        ]
    if name == "vllm-router":
        return [
            executable, "--vllm-pd-disaggregation", "--kv-connector", "nixl",
            "--prefill", prefill.url, "--decode", decode.url,
            "--host", "127.0.0.1", "--port", str(port), "--policy", "random",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--log-level", "warning",
        ]
    raise ValueError(f"unknown anchor {name!r}; known: {', '.join(ANCHORS)}")


PROBE_BODY: Final = orjson.dumps(
    {"model": "stub-model", "prompt": "ready?", "max_tokens": 1, "stream": False}
)


def serves_pd(port: int) -> bool:
    """Whether the router on ``port`` answers a PD completion with 200: it listens, and it
    has registered both workers (both routers take a moment for the second)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("POST", "/v1/completions", PROBE_BODY,
                           {"content-type": "application/json"})
        response = connection.getresponse()
        response.read()
        return response.status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()


def start(name: str, prefill: procs.Proc, decode: procs.Proc, *, log_dir: Path,
          workers: int | None = None, prefix: list[str] | None = None,
          label: str | None = None) -> procs.Proc:
    """Start the anchor in front of the two stubs; it is up once it served a PD request.

    ``prefix`` wraps it (``taskset -c CPUS`` in the paced mode's ``--pin-sidecar``);
    ``label`` names its log file (default: the anchor's name)."""
    executable = find(name)
    if executable is None:
        raise RuntimeError(f"{name}: not installed ({INSTALL_HINT})")
    env = procs.child_env()
    if workers:
        env["TOKIO_WORKER_THREADS"] = str(workers)
    argv: list[str] = []

    def build(port: int, metrics_port: int) -> list[str]:
        argv[:] = [*(prefix or []),
                   *command(name, executable, prefill, decode, port, metrics_port)]
        return list(argv)

    proc = procs.start_server(label or name, build, serves_pd, log_dir=log_dir, env=env)
    proc.info.update(version=version(name, executable), command=" ".join(argv),
                     tokio_worker_threads=workers or "default (cores)",
                     threads_at_start=thread_count(proc.pid))
    return proc


def thread_count(pid: int) -> int:
    """Threads of ``pid`` now (the routers' runtimes: one worker per core, plus their own)."""
    with contextlib.suppress(OSError):
        return sum(1 for _ in Path(f"/proc/{pid}/task").iterdir())
    return 0
