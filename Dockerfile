# syntax=docker/dockerfile:1
#
# disagg-sidecar container image.
#
# Two stages: "build" turns the source tree into a wheel and installs it with its dependencies
# into a virtual environment at /opt/venv (extension modules stripped of their symbols);
# "runtime" copies only that environment onto a fresh slim Python base, so no build tool, no
# wheel cache and no source tree reach the final image. Every dependency ships manylinux
# wheels for CPython 3.11, so no compiler is needed; if one ever is, install it in "build" only
# (the sidecar's own wheel is pure Python: its optional Cython build, SIDECAR_COMPILE=1 in
# setup.py, measured slower per request, bench/RESULTS.md).
#
# Build:  podman build --format docker -t disagg-sidecar:0.1.0 .    (or: docker build -t ... .)
#         (the name and tag deploy/'s manifests pull; push it as REGISTRY/disagg-sidecar:0.1.0)
# Run:    podman run -p 8080:8080 -p 50051:50051 disagg-sidecar:0.1.0 serve --engine-url http://...
#
# Deliberate limits: the base is chosen by the PYTHON_IMAGE build argument and must provide a
# `python` on PATH (the interpreter path differs between images, so nothing hard-codes it); the
# two stages must use the same base, because the venv links to the base's interpreter. Its
# CPython should be built optimized (PGO and LTO, as the official images' and Debian's are):
# without, the sidecar measured 16 % more CPU per request (bench/RESULTS.md, 2026-12-07).
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
# Optional extras of the package to install: "k8s" brings the Kubernetes client that the
# prefill allowlist's Kubernetes mode (a pod label selector) needs; "tracing" the
# OpenTelemetry SDK and OTLP exporters (--otlp-endpoint). Empty: none.
ARG SIDECAR_EXTRAS=k8s,tracing
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
# binutils (strip) lives in this stage only: the wheels' extension modules ship with symbol
# tables (uvloop's alone is 13 MB, 1.6 MB stripped). Unpinned: it only removes symbols.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends binutils \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# .dockerignore admits only what the wheel needs (pyproject, README, the packages, protos).
COPY . .
# The wheel is built in isolation, then installed with its dependencies; pip compiles the
# bytecode at install time, so the runtime image can run from a read-only root filesystem.
# pip, setuptools and wheel are removed from the venv afterwards: the runtime needs none of them.
RUN python -m venv /opt/venv \
 && /opt/venv/bin/python -m pip wheel --no-cache-dir --no-deps --wheel-dir /tmp/wheels . \
 && wheel_file=$(echo /tmp/wheels/*.whl) \
 && /opt/venv/bin/python -m pip install --no-cache-dir \
        "${wheel_file}${SIDECAR_EXTRAS:+[${SIDECAR_EXTRAS}]}" \
 && /opt/venv/bin/python -m pip uninstall --yes pip setuptools wheel \
 && find /opt/venv -name '*.so' -type f -exec strip --strip-unneeded {} + \
 && /opt/venv/bin/disagg-sidecar --help > /dev/null

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="disagg-sidecar" \
      org.opencontainers.image.description="Prefill/decode disaggregation sidecar for vLLM, SGLang and TensorRT-LLM" \
      org.opencontainers.image.licenses="Apache-2.0"
# A fixed numeric UID/GID so Kubernetes' runAsNonRoot can verify it without /etc/passwd lookups.
RUN groupadd --gid 10001 sidecar \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin sidecar
COPY --from=build /opt/venv /opt/venv
# A sidecar in a pod serves from as many worker processes as the container has cores for
# (its CPU limit, else its CPU affinity) and memory for (96 MiB each under its memory limit),
# one where it holds a KV-event index: docs/operating/workers.md. DISAGG_WORKERS=1 for one.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    DISAGG_WORKERS=auto
USER 10001:10001
WORKDIR /tmp
# HTTP (OpenAI front door, /health, /ready, /metrics), gRPC (PrefillWorker/DecodeWorker),
# and the optional separate metrics port (--metrics-port 9090).
EXPOSE 8080 50051 9090
# For podman/docker only (Kubernetes ignores it and uses the probes in deploy/). The image has
# no curl; the stdlib client asks the sidecar's liveness endpoint on DISAGG_PORT, proxies off.
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.build_opener(u.ProxyHandler({})).open('http://127.0.0.1:%s/health' % os.environ.get('DISAGG_PORT', '8080'), timeout=2)"]
ENTRYPOINT ["disagg-sidecar"]
CMD ["serve"]
