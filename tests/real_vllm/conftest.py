"""Session fixtures of the ``real_vllm`` suite: one stack of real vLLM engines per session.

Every test collected under tests/real_vllm/ gets the ``real_vllm`` marker (so the ordinary
suite's ``-m "not real_vllm"`` leaves it out) and a longer timeout, since the first test pays
for starting the engines.

Fixtures:
- ``real_vllm`` (session): a ``stack.RealVllm`` with the baseline URL, the NIXL and
  ExampleConnector pairs (``.nixl.prefill``, ``.nixl.decode``, ...), the engine venv's python.
- ``engine_env`` (session): the ``harness.EngineEnv`` alone (no engine started), for tests
  that only run scripts in the engine venv.
- ``vllm_schema`` (session): an ``engine_schema.VllmSchema``; ``.validate(kind, body)``
  checks a body against vLLM's own request models (None = accepted).
- ``metric`` (function): ``metric(url, name, **labels) -> float`` reads /metrics.

Cleanup: the engines are stopped by the fixture's finalizer, by an ``atexit`` hook if that
never runs, on SIGTERM to the test process (turned into an interrupt so the finalizers run),
and by the kernel if the test process dies outright (PR_SET_PDEATHSIG, see harness.py).

Deliberate limits: a missing engine environment is an error, not a skip: the suite is only
selected where it is meant to run (``bash tests/real_vllm/setup_env.sh`` builds it).
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import pytest

from real_vllm.client import metric_value
from real_vllm.engine_schema import VllmSchema
from real_vllm.harness import EngineEnv, EngineEnvMissing, EngineGroup
from real_vllm.stack import RealVllm, start_stack

_SUITE_DIR = Path(__file__).resolve().parent
# The first test waits for five engines to start on two cores (about 1-2 min), on top of
# its own work.
SUITE_TIMEOUT_S = 600


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _SUITE_DIR in item.path.resolve().parents:
            item.add_marker(pytest.mark.real_vllm)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(SUITE_TIMEOUT_S))


def _interrupt_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def engine_env() -> EngineEnv:
    try:
        return EngineEnv.locate()
    except EngineEnvMissing as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def real_vllm(engine_env: EngineEnv) -> Iterator[RealVllm]:
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt_on_sigterm)
    try:
        with EngineGroup(engine_env) as group:
            yield start_stack(group)
    finally:
        if previous is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.fixture(scope="session")
def vllm_schema(engine_env: EngineEnv) -> Iterator[VllmSchema]:
    with VllmSchema(engine_env) as schema:
        yield schema


@pytest.fixture
def metric() -> Callable[..., float]:
    return metric_value
