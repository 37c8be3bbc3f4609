"""Starts, watches and stops real vLLM engines (CPU build) as subprocesses for the test suite.

Owns: where the engine environment lives (``EngineEnv``), what one engine is
(``EngineSpec`` -> ``Engine``), and the lifecycle of a group of them (``EngineGroup``):

    specs --spawn (main thread, own process group)--> Popen + log file
          --poll GET /health until 200, bounded deadline, fail fast on exit--> ready
            (a start that lost a race inside vLLM, ``START_RACE``: started once more)
          --stop: SIGTERM the group, wait, SIGKILL the group--> gone (temp dir removed)

Every engine gets its own temp dir (caches, TMPDIR, HOME, log), ports chosen free by the OS
and held for it (see Ports below), loopback-only networking (UCX on ``lo``, NIXL side channel
and Mooncake's transfer engine on 127.0.0.1; a Mooncake producer's bootstrap server on its own
free port) and one pinned core.
Nothing survives: ``EngineGroup`` is a context manager, a module ``atexit`` hook kills any
group still alive, and each engine asks the kernel to SIGTERM it if the test process dies
(``PR_SET_PDEATHSIG``; engines are spawned from the main thread for that reason).

Engine flags the sidecar's routes need (``ROUTE_FLAGS``, given by ``stack.py``):
``--enable-scale-out``, without which vLLM 0.32 answers every ``/inference/v1/generate``
request 403 (``tests/fixtures/vllm/0.32.0/routes/generate_disabled.json``), and
``--enable-prompt-tokens-details``, without which usage carries no prompt-cache figures (the
usage rule then has none to tell).

Ports: ``free_port()`` reserves a loopback port and holds it (a socket bound to it, not
listening, ``SO_REUSEADDR``) until the group whose engine took it closes, or the test process
ends. While it is held the kernel hands it to no one else (``bind`` to port 0 skips it, and so
does a ``connect``'s ephemeral port), and a socket that binds it without ``SO_REUSEADDR``
fails; the engines' own listeners (vLLM's API server, the ZeroMQ side channels, uvicorn's
Mooncake bootstrap server) set ``SO_REUSEADDR`` and bind and listen on it as if it were free.
Releasing a probed port before its engine bound it let another engine's ephemeral port take
it in between (seen: a side-channel port equal to another engine's, that engine never healthy).
A restarted engine takes its ports again from the same reservation.

Deliberate limits: Linux only (the reservation relies on Linux's bind rules); the engine
environment is built by setup_env.sh, never here.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.32.0"
SERVED_MODEL_NAME = "tiny"
BLOCK_SIZE = 32
MAX_MODEL_LEN = 512
KV_CACHE_BYTES = 64 * 1024 * 1024
#: vLLM 0.32 serves /inference/v1/generate only with --enable-scale-out; usage reports the
#: prefix cache's figures only with --enable-prompt-tokens-details.
ROUTE_FLAGS: tuple[str, ...] = ("--enable-scale-out", "--enable-prompt-tokens-details")
# Poll delay of NIXL's progress thread, in microseconds (see nixl_hook.py).
NIXL_PTHR_DELAY_US = 100_000
#: The NIXL connectors (each engine gets a side-channel port of its own).
NIXL_CONNECTORS = frozenset({"NixlConnector", "NixlPushConnector"})
START_DEADLINE_S = 240.0
#: A start that lost a race inside vLLM rather than failed: vLLM 0.32's Mooncake connector
#: gives a data-parallel rank three tries in about 3 s to register with the bootstrap server
#: that rank 0 starts (``_BOOTSTRAP_MAX_ATTEMPTS``, no setting; "rank 0 may be busy", its own
#: comment), then the rank's engine core dies while the API server waits for it, up and never
#: healthy. Short on a slow 2-core VM (one clean-clone run in two, 2026-12-07);
#: ``EngineGroup.start`` starts such an engine once more.
START_RACE = re.compile(
    r"Failed to register .* with the Mooncake bootstrap server at \S+ after \d+ attempts"
)
STOP_GRACE_S = 20.0
HEALTH_POLL_S = 0.25

_HERE = Path(__file__).resolve().parent
# Variables from the caller's environment that would change what an engine does or where it
# writes; everything an engine needs is set explicitly instead.
_DROPPED_PREFIXES = ("VLLM_", "HF_", "TRANSFORMERS_", "TORCH", "UCX_", "NIXL_", "DISAGG_")
_DROPPED_NAMES = frozenset(
    {
        "PYTHONPATH",
        "PYTHONHOME",
        "VIRTUAL_ENV",
        "http_proxy",
        "https_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "all_proxy",
        "ALL_PROXY",
        "CUDA_VISIBLE_DEVICES",
    }
)


class EngineEnvMissing(RuntimeError):
    """The engine environment has not been built (run tests/real_vllm/setup_env.sh)."""


class EngineStartError(RuntimeError):
    """An engine exited or did not become healthy in time; the message has its log tail."""


class EngineStartRace(EngineStartError):
    """An engine's start lost a race of vLLM's own (``START_RACE``): started again, it
    comes up."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


@dataclass(frozen=True)
class EngineEnv:
    """The cached engine environment that setup_env.sh builds."""

    root: Path
    python: Path
    model_dir: Path
    vllm_version: str = VLLM_VERSION

    @property
    def mooncake_ready(self) -> bool:
        """setup_env.sh installed Mooncake's transfer engine and patched the connector."""
        return (self.root / ".mooncake-ready").is_file()

    @property
    def modelinfo_cache(self) -> Path:
        """vLLM's model-info cache made by setup_env.sh (seeded into each engine's cache)."""
        return self.root / "vllm-cache" / "modelinfos"

    @classmethod
    def locate(cls) -> EngineEnv:
        default = Path.home() / ".cache" / "disagg-sidecar" / f"vllm-{VLLM_VERSION}"
        root = Path(os.environ.get("DISAGG_VLLM_ENV", str(default)))
        env = cls(root=root, python=root / "venv" / "bin" / "python", model_dir=root / "model-tiny")
        ready = [root / ".venv-ready", root / ".model-ready", root / ".connector-ready",
                 env.python, env.model_dir]
        missing = [str(p) for p in ready if not p.exists()]
        if missing:
            raise EngineEnvMissing(
                f"real-vLLM environment not built at {root} (missing: {', '.join(missing)}); "
                f"run: bash {_HERE / 'setup_env.sh'}"
            )
        return env


@dataclass(frozen=True)
class EngineSpec:
    """What to start: a name for logs, a KV connector config, the core to pin it to.

    ``extra_env`` is applied last over the harness's environment (e.g. ``PYTHONPATH`` for an
    out-of-tree KV connector); ``extra_args`` is appended to the server's command line.
    """

    name: str
    kv_transfer_config: Mapping[str, Any] | None = None
    cpu: int = 0
    prefix_caching: bool = True
    extra_args: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)
    #: Fixed HTTP and NIXL side-channel ports (None: free ones), e.g. to restart an engine
    #: where its peers know it.
    port: int | None = None
    side_channel_port: int | None = None

    @property
    def uses_nixl(self) -> bool:
        cfg = self.kv_transfer_config
        return cfg is not None and cfg.get("kv_connector") in NIXL_CONNECTORS

    @property
    def serves_mooncake_bootstrap(self) -> bool:
        """A Mooncake producer runs the bootstrap server (``/query``) decode engines ask."""
        cfg = self.kv_transfer_config
        return (
            cfg is not None
            and cfg.get("kv_connector") == "MooncakeConnector"
            and cfg.get("kv_role") != "kv_consumer"
        )


@dataclass
class Engine:
    """One running engine: its URL, process, log and the ports it was given."""

    spec: EngineSpec
    port: int
    side_channel_port: int | None
    process: subprocess.Popen[bytes]
    workdir: Path
    started_at: float
    ready_after_s: float | None = None
    mooncake_bootstrap_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "engine.log"

    def log_text(self) -> str:
        """The whole log so far (or why there is none)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"<no log: {exc}>"

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def lost_start_race(self) -> str | None:
        """The log's line that says this engine's start lost a race (``START_RACE``)."""
        found = START_RACE.search(self.log_text())
        return found.group(0) if found else None


#: Reserved ports, by number: the socket that holds each (see the module docstring).
_RESERVED: dict[int, socket.socket] = {}


def _hold(port: int) -> socket.socket:
    """Bind ``port`` (0: any) exclusively, then let its engine's ``SO_REUSEADDR`` bind in.

    The bind itself goes without ``SO_REUSEADDR``, so it fails while any other socket has the
    port; the flag set afterwards is what lets the engine's listener share it (Linux checks
    the holder's flag when the second socket binds).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    except OSError:
        sock.close()
        raise
    return sock


def free_port() -> int:
    """A loopback port reserved for this process (held until ``release_port`` or exit)."""
    sock = _hold(0)
    port: int = sock.getsockname()[1]
    _RESERVED[port] = sock
    return port


def release_port(port: int) -> None:
    """Give a reserved port back to the OS (nothing if it is not reserved)."""
    sock = _RESERVED.pop(port, None)
    if sock is not None:
        sock.close()


def free_port_run(count: int) -> int:
    """A base port such that ``base .. base + count - 1`` are reserved for this process (a
    data-parallel NIXL engine listens on its side-channel port + rank)."""
    for _ in range(200):
        base = free_port()
        held = [base]
        try:
            for port in range(base + 1, base + count):
                if port > 65535:
                    raise OSError(f"port {port} out of range")
                _RESERVED[port] = _hold(port)
                held.append(port)
        except OSError:
            for port in held:
                release_port(port)
            continue
        return base
    raise RuntimeError(f"no run of {count} free loopback ports found")


@atexit.register
def _release_all_ports() -> None:
    for port in list(_RESERVED):
        release_port(port)


def nixl_config(role: str) -> dict[str, Any]:
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}


def nixl_push_config(role: str, engine_id: str | None = None) -> dict[str, Any]:
    """NixlPushConnector (vLLM 0.32); ``engine_id`` fixes the id (a random one otherwise)."""
    config: dict[str, Any] = {"kv_connector": "NixlPushConnector", "kv_role": role,
                              "kv_buffer_device": "cpu"}
    if engine_id is not None:
        config["engine_id"] = engine_id
    return config


def mooncake_config(role: str, engine_id: str | None = None) -> dict[str, Any]:
    """MooncakeConnector over TCP (the CPU build has no RDMA device); ``engine_id`` fixes the
    id the producer registers with its bootstrap server (vLLM picks a uuid otherwise)."""
    config: dict[str, Any] = {
        "kv_connector": "MooncakeConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
    }
    if engine_id is not None:
        config["engine_id"] = engine_id
    return config


def example_config(storage_dir: Path) -> dict[str, Any]:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)},
    }


# Resolved in the parent: the child between fork and exec should call, not dlopen.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if the test process dies without cleaning
    # up (SIGKILL, crash), the kernel sends the engine SIGTERM, which stops its whole tree.
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _base_environ() -> dict[str, str]:
    return {
        k: v
        for k, v in os.environ.items()
        if k not in _DROPPED_NAMES and not k.startswith(_DROPPED_PREFIXES)
    }


def _engine_environ(
    env: EngineEnv,
    spec: EngineSpec,
    workdir: Path,
    side_port: int | None,
    bootstrap_port: int | None = None,
) -> dict[str, str]:
    environ = _base_environ()
    dirs = {
        "HOME": workdir / "home",
        "TMPDIR": workdir / "tmp",
        "VLLM_CACHE_ROOT": workdir / "cache" / "vllm",
        "VLLM_CONFIG_ROOT": workdir / "config",
        "TORCHINDUCTOR_CACHE_DIR": workdir / "cache" / "inductor",
        "HF_HOME": workdir / "cache" / "hf",
        "XDG_CACHE_HOME": workdir / "cache",
        "XDG_CONFIG_HOME": workdir / "config",
    }
    for name, path in dirs.items():
        path.mkdir(parents=True, exist_ok=True)
        environ[name] = str(path)
    # Spares each engine a subprocess that imports all of vLLM to inspect the model class;
    # vLLM checks the entry against its own source hash, so a stale one is only ignored.
    if env.modelinfo_cache.is_dir():
        shutil.copytree(env.modelinfo_cache, dirs["VLLM_CACHE_ROOT"] / "modelinfos")
    environ.update(
        {
            "PATH": f"{env.python.parent}{os.pathsep}{environ.get('PATH', '')}",
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            # Keep vLLM's own distributed init and NIXL/UCX on loopback.
            "VLLM_HOST_IP": "127.0.0.1",
            "UCX_NET_DEVICES": "lo",
            "VLLM_CPU_OMP_THREADS_BIND": str(spec.cpu),
            "DISAGG_NIXL_PTHR_DELAY_US": str(NIXL_PTHR_DELAY_US),
            # A NIXL worker stays on its engine's core (vLLM would move it to the last core).
            "DISAGG_NIXL_KEEP_CORES": "1",
        }
    )
    if side_port is not None:
        environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_port)
    if bootstrap_port is not None:
        # vLLM's Mooncake bootstrap server binds 0.0.0.0 on this port (default 8998).
        environ["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(bootstrap_port)
    environ.update(spec.extra_env)
    return environ


def _engine_argv(env: EngineEnv, spec: EngineSpec, port: int) -> list[str]:
    argv = [
        str(env.python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(env.model_dir),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--enforce-eager",
        "--block-size",
        str(BLOCK_SIZE),
        "--kv-cache-memory-bytes",
        str(KV_CACHE_BYTES),
        "--seed",
        "0",
    ]
    if not spec.prefix_caching:
        argv.append("--no-enable-prefix-caching")
    if spec.kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(dict(spec.kv_transfer_config))]
    argv += list(spec.extra_args)
    return argv


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def stop_process_group(process: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the engine's process group, then SIGKILL it if it outlives ``grace_s``."""
    _signal_group(process, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)
    # The group may hold children that outlived their parent (engine core, workers).
    _signal_group(process, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)


def _health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2.0) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


@dataclass
class EngineGroup:
    """A set of engines started together and stopped together (a context manager)."""

    env: EngineEnv
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="real-vllm-")))
    engines: dict[str, Engine] = field(default_factory=dict)
    #: The ports this group's engines took (released when the group closes, not when an
    #: engine stops: a restart takes them again).
    ports: set[int] = field(default_factory=set)

    def __enter__(self) -> EngineGroup:
        _LIVE_GROUPS.add(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def spawn(self, spec: EngineSpec, *, reuse: Engine | None = None) -> Engine:
        """Start ``spec``; ``reuse``: a stopped engine whose ports it takes (a restart)."""
        if spec.name in self.engines:
            raise ValueError(f"engine {spec.name!r} already started in this group")
        _LIVE_GROUPS.add(self)
        workdir = self.root / spec.name
        if reuse is not None:
            workdir = self.root / f"{spec.name}.{len(list(self.root.glob(spec.name + '*')))}"
        elif workdir.exists():  # a restarted engine: the old one's files go
            shutil.rmtree(workdir)
        workdir.mkdir(parents=True)
        port: int
        side_port: int | None
        bootstrap_port: int | None
        if reuse is not None:
            # Every port again, the bootstrap server's too: a sidecar started with
            # --mooncake-bootstrap-port names it (the data-parallel warm-up restarts engines).
            port, side_port = reuse.port, reuse.side_channel_port
            bootstrap_port = reuse.mooncake_bootstrap_port
        else:
            port = spec.port or free_port()
            side_port = (spec.side_channel_port or free_port()) if spec.uses_nixl else None
            bootstrap_port = free_port() if spec.serves_mooncake_bootstrap else None
        self.ports.update(p for p in (port, side_port, bootstrap_port) if p is not None)
        log = (workdir / "engine.log").open("wb")
        try:
            process = subprocess.Popen(
                _engine_argv(self.env, spec, port),
                env=_engine_environ(self.env, spec, workdir, side_port, bootstrap_port),
                cwd=workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # Not thread-safe in general; engines are spawned from the main thread only.
                preexec_fn=_die_with_parent,
            )
        finally:
            log.close()
        engine = Engine(
            spec=spec,
            port=port,
            side_channel_port=side_port,
            process=process,
            workdir=workdir,
            started_at=time.monotonic(),
            mooncake_bootstrap_port=bootstrap_port,
        )
        self.engines[spec.name] = engine
        return engine

    def wait_ready(
        self, names: Iterable[str] | None = None, deadline_s: float = START_DEADLINE_S
    ) -> None:
        """Poll /health of each engine until all answer 200; fail fast if one exits or its
        log shows a lost start race (``EngineStartRace``)."""
        pending = {n: self.engines[n] for n in (names or list(self.engines))}
        deadline = time.monotonic() + deadline_s
        while pending:
            for name, engine in list(pending.items()):
                code = engine.process.poll()
                healthy = code is None and _health_ok(engine.url)
                race = None if healthy else engine.lost_start_race()
                if race is not None:
                    raise EngineStartRace(name, f"engine {name}'s start lost a race: {race}")
                if code is not None:
                    raise EngineStartError(
                        f"engine {name} exited with {code} before it was healthy; log tail:\n"
                        f"{engine.log_tail()}"
                    )
                if healthy:
                    engine.ready_after_s = time.monotonic() - engine.started_at
                    del pending[name]
            if not pending:
                break
            if time.monotonic() > deadline:
                name, engine = next(iter(pending.items()))
                raise EngineStartError(
                    f"engines {sorted(pending)} not healthy after {deadline_s:.0f}s; "
                    f"log tail of {name}:\n{engine.log_tail()}"
                )
            # Readiness is only observable by asking; this bounds how often we ask.
            time.sleep(HEALTH_POLL_S)

    def restart(self, name: str, deadline_s: float = START_DEADLINE_S, *,
                kill: bool = False) -> Engine:
        """Stop engine ``name`` (``kill``: SIGKILL to its process group at once, as a crash)
        and start it again on the same ports (its clients see the same engine restarted,
        with an empty cache), then wait until it is healthy."""
        self._respawn(name, kill=kill)
        return self._await_start([name], deadline_s)[name]

    def start(
        self, specs: Iterable[EngineSpec], deadline_s: float = START_DEADLINE_S
    ) -> dict[str, Engine]:
        """Spawn all specs at once, then wait until every one is healthy."""
        names = [self.spawn(spec).spec.name for spec in specs]
        return self._await_start(names, deadline_s)

    def _await_start(self, names: list[str], deadline_s: float) -> dict[str, Engine]:
        """``wait_ready``, where an engine whose start lost a race (``START_RACE``) is
        started once more on its ports; a second lost race fails like any start."""
        restarted: set[str] = set()
        while True:
            try:
                self.wait_ready(names, deadline_s)
                return {name: self.engines[name] for name in names}
            except EngineStartRace as race:
                if race.name in restarted:
                    raise
                print(f"{race}; starting {race.name} once more")
                restarted.add(race.name)
                self._respawn(race.name, kill=True)

    def _respawn(self, name: str, *, kill: bool) -> Engine:
        old = self.engines.pop(name)
        if kill:
            _signal_group(old.process, signal.SIGKILL)
        stop_process_group(old.process)
        return self.spawn(old.spec, reuse=old)

    def stop(self, name: str) -> Engine:
        """Stop one engine and forget it (its ports stay reserved for the group, so the same
        engine can start on them again); the engine it was."""
        engine = self.engines.pop(name)
        stop_process_group(engine.process)
        return engine

    def close(self) -> None:
        """Stop every engine (all at once, then wait) and remove the group's temp dir."""
        for engine in self.engines.values():
            if engine.process.poll() is None:
                _signal_group(engine.process, signal.SIGTERM)
        for engine in self.engines.values():
            stop_process_group(engine.process)
        # REAL_VLLM_KEEP_LOGS=1 keeps the engines' logs and caches for a failure's reader.
        if os.environ.get("REAL_VLLM_KEEP_LOGS") != "1":
            shutil.rmtree(self.root, ignore_errors=True)
        for port in self.ports:
            release_port(port)
        self.ports.clear()
        _LIVE_GROUPS.discard(self)

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


_LIVE_GROUPS: set[EngineGroup] = set()


@atexit.register
def _close_live_groups() -> None:
    for group in list(_LIVE_GROUPS):
        group.close()


@contextlib.contextmanager
def engine_group(env: EngineEnv | None = None) -> Iterator[EngineGroup]:
    with EngineGroup(env or EngineEnv.locate()) as group:
        yield group
