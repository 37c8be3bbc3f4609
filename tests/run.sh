#!/usr/bin/env bash
# Sets up the project's virtual environment (if needed) and runs every check CI runs:
# ruff, mypy, the unit/integration suites (stub engines, real sockets), the container and
# manifest checks, the request path's suites again against the compiled build (Cython, in a
# copy of the tree: setup.py), and the real-vLLM end-to-end suite (its engine environment is
# built once and cached outside the repository, see tests/real_vllm/setup_env.sh).
#
#   bash tests/run.sh            everything (what .ci/run runs)
#   SKIP_REAL_VLLM=1 bash tests/run.sh    everything but the real-vLLM suite (a quick local loop)
#   SKIP_COMPILED=1 bash tests/run.sh     without the compiled build's suites
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

if [ "${SKIP_COMPILED:-0}" != "1" ]; then
  echo "== the compiled build: the request path's suites against the hot modules compiled"
  # A copy of the tracked tree, compiled in place (the checkout itself stays pure Python, as
  # the editable install wants it); tests run from there, so its extensions are imported.
  compiled_tree=$(mktemp -d)
  trap 'rm -rf "$compiled_tree"' EXIT
  git ls-files -z | xargs -0 tar -cf - | tar -xf - -C "$compiled_tree"
  # The optional compiled build (setup.py, SIDECAR_COMPILE): kept working by the same suites.
  # The C compiler's warnings about Cython's generated code go to a log, shown on failure.
  if ! (cd "$compiled_tree" && SIDECAR_COMPILE=1 "$OLDPWD/.venv/bin/python" setup.py \
      -q build_ext --inplace -j 2 >"$compiled_tree/build.log" 2>&1); then
    tail -n 40 "$compiled_tree/build.log"
    exit 1
  fi
  (cd "$compiled_tree" && SIDECAR_EXPECT_COMPILED=1 PYTHONPATH="$compiled_tree" \
      "$OLDPWD/.venv/bin/python" -m pytest -q -m "not real_vllm" -p no:cacheprovider \
      tests/test_compiled.py tests/http tests/request tests/http1 tests/targets \
      tests/protocol tests/faults tests/observability tests/grpc_server tests/dialects)
fi

if [ "${SKIP_REAL_VLLM:-0}" != "1" ]; then
  echo "== real vLLM engines on CPU"
  bash tests/real_vllm/setup_env.sh
  .venv/bin/python -m pytest -q -m real_vllm tests/real_vllm -p no:cacheprovider
fi
