"""The committed generated code is exactly what ``python -m sidecar.tools.grpc_regen`` writes.

Proves: regenerating protos/disagg.proto into a temporary directory with this venv's
grpcio-tools and mypy-protobuf gives byte-identical files; the gRPC modules import the messages
as ``sidecar.grpc_gen.disagg_pb2`` (no ``sys.path`` tricks); ``--check`` agrees. Does not
prove the code is right (the other contract tests do).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sidecar.tools import grpc_regen as regen

REGEN_HINT = "run python -m sidecar.tools.grpc_regen"


def test_committed_generated_code_is_fresh() -> None:
    stale = regen.stale_files()
    # A different generator version also changes the bytes (it stamps its version in them):
    # the message names the installed ones so that case is told apart at once.
    assert not stale, (
        f"generated code is stale ({', '.join(stale)}): {REGEN_HINT} "
        f"(installed generators: {regen.generator_versions()})"
    )


def test_every_generated_file_is_committed_next_to_the_package() -> None:
    missing = [name for name in regen.GENERATED_FILES if not (regen.PACKAGE_DIR / name).is_file()]
    assert not missing, f"missing {missing}: {REGEN_HINT}"


def test_stale_file_is_detected(tmp_path: Path) -> None:
    for name in regen.GENERATED_FILES:
        (tmp_path / name).write_bytes((regen.PACKAGE_DIR / name).read_bytes())
    assert regen.stale_files(tmp_path) == []
    (tmp_path / "disagg_pb2.py").write_bytes(b"# edited by hand\n")
    (tmp_path / "disagg_pb2_grpc.pyi").unlink()
    assert regen.stale_files(tmp_path) == ["disagg_pb2.py", "disagg_pb2_grpc.pyi"]
    assert sorted(regen.regenerate(tmp_path)) == ["disagg_pb2.py", "disagg_pb2_grpc.pyi"]
    assert regen.stale_files(tmp_path) == []


def test_check_command_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert regen.main(["--check"]) == 0, capsys.readouterr().out


def test_grpc_modules_import_the_messages_by_package() -> None:
    from sidecar.grpc_gen import disagg_pb2, disagg_pb2_grpc

    assert vars(disagg_pb2_grpc)["disagg__pb2"] is disagg_pb2
    assert "disagg_pb2" not in sys.modules  # nothing imported it as a top-level module
    for name in ("disagg_pb2_grpc.py", "disagg_pb2_grpc.pyi"):
        text = (regen.PACKAGE_DIR / name).read_text(encoding="utf-8")
        assert "from sidecar.grpc_gen import disagg_pb2 as " in text
        assert "\nimport disagg_pb2" not in text
