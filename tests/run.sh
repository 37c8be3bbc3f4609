#!/usr/bin/env bash
# Sets up the project's virtual environment (if needed) and runs every check CI runs:
# ruff, mypy, the unit/integration suite, and the real-vLLM suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[dev]'
.venv/bin/ruff check .
.venv/bin/mypy
# pytest exits 5 when it collects nothing: that is a failure here too.
.venv/bin/python -m pytest -q -m "not real_vllm"
