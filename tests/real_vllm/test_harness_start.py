"""The harness starts once more an engine whose start lost a race inside vLLM.

Proves: an engine whose log shows vLLM's Mooncake registration giving up (``START_RACE``,
the API server up and never healthy) is stopped and started again on the same ports, and the
group's start returns once it is healthy, without waiting out the start deadline; a second
lost race fails the start with the line; a restarted Mooncake producer keeps its bootstrap
server's port (a sidecar started with ``--mooncake-bootstrap-port`` names it).

Stand-in engines: a module named ``vllm.entrypoints.openai.api_server`` on the engine's
``PYTHONPATH`` that writes the line of vLLM 0.32 on the starts told to, and otherwise answers
``/health`` on its ``--port``. Does not prove that vLLM's own rank comes up on the second start
(the data-parallel Mooncake class does that with real engines).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from real_vllm.harness import (
    EngineEnv,
    EngineGroup,
    EngineSpec,
    EngineStartRace,
    mooncake_config,
)

# Writes each start's --port to a line of $STAND_IN_STARTS; on the starts listed in
# $STAND_IN_RACES (1-based) it writes the race's line and then stays up unhealthy, as vLLM's
# API server does.
_API_SERVER = """
import http.server, os, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
starts = os.environ["STAND_IN_STARTS"]
with open(starts, "a") as f:
    f.write(f"{port}\\n")
n = len(open(starts).read().splitlines())
if str(n) in os.environ["STAND_IN_RACES"].split(","):
    print("(EngineCore_DP1 pid=1) ERROR RuntimeError: Worker failed with error 'Failed to "
          "register engine_id='x_dp1' dp_rank=1 tp_rank=0 pp_rank=0 addr='tcp://127.0.0.1:1' "
          "with the Mooncake bootstrap server at http://127.0.0.1:2/register after 3 "
          "attempts.'", flush=True)
    time.sleep(600)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _stand_in(tmp_path: Path, races: str, kv_transfer_config: dict[str, Any] | None = None
              ) -> tuple[EngineEnv, EngineSpec, Path]:
    package = tmp_path / "site" / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for folder in (package, package.parent, package.parent.parent):
        (folder / "__init__.py").write_text("")
    (package / "api_server.py").write_text(_API_SERVER)
    starts = tmp_path / "starts"
    env = EngineEnv(root=tmp_path, python=Path(sys.executable), model_dir=tmp_path)
    extra_env = {"PYTHONPATH": str(tmp_path / "site"), "STAND_IN_STARTS": str(starts),
                 "STAND_IN_RACES": races}
    spec = EngineSpec("stand-in", kv_transfer_config, extra_env=extra_env)
    return env, spec, starts


def _ports(starts: Path) -> list[int]:
    """The --port of each start so far."""
    return [int(line) for line in starts.read_text().splitlines()]


def test_a_start_that_lost_the_race_is_started_once_more_on_its_ports(tmp_path: Path) -> None:
    env, spec, starts = _stand_in(tmp_path, races="1")
    with EngineGroup(env) as group:
        # Had the line not ended the first wait, its deadline would have: EngineStartError.
        engine = group.start([spec], deadline_s=120)["stand-in"]
        assert _ports(starts) == [engine.port, engine.port]
        assert engine.workdir.name.startswith("stand-in.")  # the second start's own dir
        first_log = group.root / "stand-in" / "engine.log"
        assert "with the Mooncake bootstrap server" in first_log.read_text()
        assert engine.process.poll() is None
        assert group.engines["stand-in"] is engine


def test_a_second_lost_race_fails_the_start_with_the_line(tmp_path: Path) -> None:
    env, spec, starts = _stand_in(tmp_path, races="1,2")
    group = EngineGroup(env)
    with group, pytest.raises(EngineStartRace) as failure:
        group.start([spec], deadline_s=120)
    assert "Failed to register engine_id='x_dp1'" in str(failure.value)
    assert len(_ports(starts)) == 2
    assert group.engines["stand-in"].process.returncode is not None
    assert not group.root.exists()


def test_a_restarted_mooncake_producer_keeps_its_bootstrap_port(tmp_path: Path) -> None:
    env, spec, _ = _stand_in(tmp_path, races="",
                             kv_transfer_config=mooncake_config("kv_producer"))
    with EngineGroup(env) as group:
        first = group.start([spec])["stand-in"]
        assert first.mooncake_bootstrap_port is not None
        again = group.restart("stand-in")
        assert (again.port, again.mooncake_bootstrap_port) == (
            first.port, first.mooncake_bootstrap_port)
