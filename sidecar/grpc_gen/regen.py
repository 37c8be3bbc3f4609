"""Regenerate the committed Python code of ``protos/disagg.proto`` (a developer tool).

    python -m sidecar.grpc_gen.regen            # rewrite the generated files
    python -m sidecar.grpc_gen.regen --check    # exit 1 and name the files that are stale

    protos/disagg.proto ─protoc (grpcio-tools)─▶ disagg_pb2.py, disagg_pb2.pyi   (messages)
                                               ─▶ disagg_pb2_grpc.py             (stubs, servicers)
                        ─protoc-gen-mypy_grpc──▶ disagg_pb2_grpc.pyi             (their types)
                        ─one import line rewritten─▶ sidecar/grpc_gen/

protoc names the proto ``disagg.proto`` (``-I protos``), so the gRPC modules it writes say
``import disagg_pb2``, which only works with ``sidecar/grpc_gen`` on ``sys.path``. That one
line is rewritten to ``from sidecar.grpc_gen import disagg_pb2`` (exactly one occurrence per
gRPC module, or generation fails). Nothing else is touched, so the output is byte-for-byte
what this venv's grpcio-tools and mypy-protobuf produce; ``tests/grpc_contract`` checks that
the committed files are exactly that.

Deliberate limits: it runs from a source checkout (it needs ``protos/``), with the protoc of
the running interpreter's grpcio-tools and the ``protoc-gen-mypy_grpc`` plugin installed next
to that interpreter (the ``dev`` extra). The generated code pins its minimum runtime versions
(grpcio, protobuf) to the generator's; regenerating with a newer grpcio-tools raises them.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGE = "sidecar.grpc_gen"
PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parents[1]
PROTO_DIR = REPO_ROOT / "protos"
PROTO_NAME = "disagg.proto"

MESSAGES_MODULE = "disagg_pb2"
#: Every file this tool writes, in the order it writes them.
GENERATED_FILES = (
    "disagg_pb2.py",
    "disagg_pb2.pyi",
    "disagg_pb2_grpc.py",
    "disagg_pb2_grpc.pyi",
)
#: The gRPC modules whose top-level import of the messages module is rewritten.
_GRPC_FILES = ("disagg_pb2_grpc.py", "disagg_pb2_grpc.pyi")
_IMPORT_LINE = re.compile(rf"^import {MESSAGES_MODULE} as (\w+)$", re.MULTILINE)
_MYPY_GRPC_PLUGIN = "protoc-gen-mypy_grpc"


class RegenError(RuntimeError):
    """protoc failed, a plugin is missing, or the output is not what the rewrite expects."""


def _mypy_grpc_plugin() -> Path:
    # The plugin is a console script of mypy-protobuf: look next to this interpreter first so
    # a venv works without being activated.
    beside = Path(sys.executable).parent / _MYPY_GRPC_PLUGIN
    if beside.is_file():
        return beside
    found = shutil.which(_MYPY_GRPC_PLUGIN)
    if found is None:
        raise RegenError(
            f"{_MYPY_GRPC_PLUGIN} not found (install mypy-protobuf, the 'dev' extra)"
        )
    return Path(found)


def _rewrite_import(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    new_text, count = _IMPORT_LINE.subn(rf"from {PACKAGE} import {MESSAGES_MODULE} as \1", text)
    if count != 1:
        raise RegenError(
            f"{path.name}: expected exactly one 'import {MESSAGES_MODULE} as ...' line, "
            f"found {count}; the generator's output changed, update regen.py"
        )
    path.write_text(new_text, encoding="utf-8")


def generate(out_dir: Path) -> list[Path]:
    """Generate every file of ``GENERATED_FILES`` into ``out_dir``; returns their paths."""
    proto = PROTO_DIR / PROTO_NAME
    if not proto.is_file():
        raise RegenError(f"{proto} not found: run from a source checkout")
    out_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"--proto_path={PROTO_DIR}",
        f"--plugin={_MYPY_GRPC_PLUGIN}={_mypy_grpc_plugin()}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        PROTO_NAME,
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RegenError(f"protoc failed ({result.returncode}): {result.stderr.strip()}")
    for name in _GRPC_FILES:
        _rewrite_import(out_dir / name)
    paths = [out_dir / name for name in GENERATED_FILES]
    missing = [path.name for path in paths if not path.is_file()]
    if missing:
        raise RegenError(f"protoc did not write {', '.join(missing)}")
    return paths


def stale_files(target_dir: Path = PACKAGE_DIR) -> list[str]:
    """Names of the generated files in ``target_dir`` that differ from a fresh generation."""
    with tempfile.TemporaryDirectory(prefix="disagg-regen-") as tmp:
        fresh = generate(Path(tmp))
        return [
            path.name
            for path in fresh
            if not (target_dir / path.name).is_file()
            or (target_dir / path.name).read_bytes() != path.read_bytes()
        ]


def regenerate(target_dir: Path = PACKAGE_DIR) -> list[str]:
    """Rewrite the generated files in ``target_dir``; returns the names that changed."""
    with tempfile.TemporaryDirectory(prefix="disagg-regen-") as tmp:
        changed = []
        for path in generate(Path(tmp)):
            target = target_dir / path.name
            content = path.read_bytes()
            # Leave unchanged files alone so their timestamps (and build caches) survive.
            if not target.is_file() or target.read_bytes() != content:
                target.write_bytes(content)
                changed.append(path.name)
        return changed


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m sidecar.grpc_gen.regen",
        description="Regenerate the Python code of protos/disagg.proto.",
    )
    parser.add_argument(
        "--check", action="store_true", help="only report stale files (exit 1 when any)"
    )
    args = parser.parse_args(argv)
    try:
        if args.check:
            stale = stale_files()
            for name in stale:
                print(f"stale: {PACKAGE_DIR / name}")
            return 1 if stale else 0
        for name in regenerate():
            print(f"wrote {PACKAGE_DIR / name}")
    except RegenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
