"""Proves grpcio is a hard dependency: a broken gRPC install fails loudly, never silently.

Before, ``serve`` and the CLI caught ``ImportError`` around the gRPC imports and went on
without the gRPC front door (or the ``route`` command) and without a word. Each case runs a
fresh interpreter in which one gRPC module cannot be imported (``sys.modules[name] = None``
makes Python raise ``ImportError`` for it) and checks that importing ``sidecar.serve`` or
building the CLI parser raises instead of succeeding.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(blocked: str, code: str) -> subprocess.CompletedProcess[str]:
    program = f"import sys\nsys.modules[{blocked!r}] = None\n{code}\n"
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=60, check=False)


@pytest.mark.parametrize(
    ("blocked", "code"),
    [
        ("sidecar.grpc_server.server", "import sidecar.serve"),
        ("grpc", "import sidecar.serve"),
        ("sidecar.tools.route",
         "from sidecar.__main__ import build_parser; build_parser()"),
    ],
)
def test_a_missing_grpc_module_is_an_import_error(blocked: str, code: str) -> None:
    result = _run(blocked, code)
    assert result.returncode != 0, result.stdout
    assert "ImportError" in result.stderr or "ModuleNotFoundError" in result.stderr


def test_with_grpc_installed_serve_and_the_route_command_load() -> None:
    result = _run("not.a.module", "import sidecar.serve\nfrom sidecar.__main__ import "
                  "build_parser\nbuild_parser().parse_args(['route', '--help'])")
    assert result.returncode == 0, result.stderr
    assert "--prefill" in result.stdout
