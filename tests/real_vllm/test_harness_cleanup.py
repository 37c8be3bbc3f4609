"""The harness's failure and stop paths leave nothing behind.

Proves: ``stop_process_group`` ends a whole process group, SIGKILLing a member that ignores
SIGTERM once the grace period is over; ``EngineGroup.close`` removes its temp dir and stops
processes that were never healthy; an engine that cannot start fails fast with the tail of
its own log in the message and leaves no process or temp dir. Stand-in Python processes,
and one real vLLM server that exits on a bad flag.

Does not prove vLLM's own shutdown (the session fixture's teardown does that for real).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from real_vllm.harness import (
    EngineEnv,
    EngineGroup,
    EngineSpec,
    EngineStartError,
    stop_process_group,
)

# A parent that ignores SIGTERM and a child that ignores it too, both in one new session;
# the child shares the parent's stdout, so EOF on that pipe means both have ended.
_STUBBORN_TREE = """
import signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print(child.pid, flush=True)
child.wait()
"""


def test_stop_process_group_kills_a_stubborn_tree() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _STUBBORN_TREE], stdout=subprocess.PIPE, start_new_session=True
    )
    assert proc.stdout is not None
    # The child is running once it has printed its pid.
    assert int(proc.stdout.readline()) > 0
    stop_process_group(proc, grace_s=0.5)
    assert proc.returncode is not None
    # EOF comes only when every holder of the pipe's write end, the child too, has exited.
    assert proc.stdout.read() == b""
    proc.stdout.close()


def test_group_close_removes_its_temp_dir(tmp_path: Path) -> None:
    env = EngineEnv(root=tmp_path, python=Path(sys.executable), model_dir=tmp_path)
    group = EngineGroup(env)
    with group:
        assert group.root.is_dir()
    assert not group.root.exists()


def test_engine_that_cannot_start_fails_with_its_log_and_leaves_nothing(
    engine_env: EngineEnv,
) -> None:
    group = EngineGroup(engine_env)
    with group, pytest.raises(EngineStartError) as failure:
        group.start([EngineSpec("broken", extra_args=("--no-such-flag",))])
    message = str(failure.value)
    assert "broken exited with" in message
    assert "--no-such-flag" in message  # the tail of vLLM's own log is in the message
    assert group.engines["broken"].process.returncode is not None
    assert not group.root.exists()
