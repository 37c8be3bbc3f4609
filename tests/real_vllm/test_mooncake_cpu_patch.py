"""The CPU patch of vLLM's MooncakeConnector (mooncake_cpu_patch.py) does one thing, once.

Proves on copies of the connector source: the known line of vLLM 0.32.0 is replaced by the
guarded one and nothing else changes; a second ``apply`` is a no-op ("already patched") that
leaves the file untouched; a source without the known line (another vLLM) is a
``PatchError`` and is not written; and the engine venv's installed connector is patched
(setup_env.sh ran ``apply``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from real_vllm.harness import EngineEnv
from real_vllm.mooncake_cpu_patch import CONNECTOR, ORIGINAL, PATCHED, PatchError, apply

HEAD = "class MooncakeConnectorWorker:\n    def __init__(self):\n"
TAIL = "        current_platform.set_device(self.device_id)\n"


def _refuse_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    def write_text(self: Path, *args: object, **kwargs: object) -> int:
        raise AssertionError(f"{self} was written")

    monkeypatch.setattr(Path, "write_text", write_text)


def test_apply_replaces_the_known_line_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "mooncake_connector.py"
    source.write_text(HEAD + ORIGINAL + TAIL)
    assert apply(source) == "patched"
    assert source.read_text() == HEAD + PATCHED + TAIL
    _refuse_writes(monkeypatch)
    assert apply(source) == "already patched"
    assert source.read_text() == HEAD + PATCHED + TAIL


@pytest.mark.parametrize(
    "text",
    [HEAD + TAIL, HEAD + ORIGINAL + ORIGINAL + TAIL, HEAD + PATCHED + ORIGINAL + TAIL],
    ids=["line-gone", "line-twice", "half-patched"],
)
def test_unknown_source_is_refused_and_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    source = tmp_path / "mooncake_connector.py"
    source.write_text(text)
    _refuse_writes(monkeypatch)
    with pytest.raises(PatchError):
        apply(source)
    assert source.read_text() == text


def test_engine_venv_connector_is_patched(engine_env: EngineEnv) -> None:
    if not engine_env.mooncake_ready:
        pytest.fail("Mooncake is not set up: run bash tests/real_vllm/setup_env.sh",
                    pytrace=False)
    site = next((engine_env.root / "venv" / "lib").glob("python3*/site-packages"))
    installed = (site / CONNECTOR).read_text()
    assert PATCHED in installed
    assert ORIGINAL not in installed
