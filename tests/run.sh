#!/usr/bin/env bash
# Sets up the project's virtual environment (if needed) and runs every check CI runs:
# ruff, mypy, the unit/integration suites (stub engines, real sockets), the container and
# manifest checks, and the real-vLLM end-to-end suite (its engine environment is built once
# and cached outside the repository, see tests/real_vllm/setup_env.sh).
#
#   bash tests/run.sh            everything (what .ci/run runs)
#   SKIP_REAL_VLLM=1 bash tests/run.sh    everything but the real-vLLM suite (a quick local loop)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[dev]'

echo "== lint and types"
.venv/bin/ruff check .
.venv/bin/mypy

echo "== unit and integration suites"
# pytest exits 5 when it collects nothing; set -e makes that (like any failure) fatal.
.venv/bin/python -m pytest -q -m "not real_vllm" -p no:cacheprovider

if [ "${SKIP_REAL_VLLM:-0}" != "1" ]; then
  echo "== real vLLM engines on CPU"
  bash tests/real_vllm/setup_env.sh
  .venv/bin/python -m pytest -q -m real_vllm tests/real_vllm -p no:cacheprovider
fi
