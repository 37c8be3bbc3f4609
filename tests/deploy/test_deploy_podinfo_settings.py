"""A sidecar started as each deploy/ manifest starts it resolves the intended settings.

For every Deployment of every overlay, the pod template's labels and annotations are written
as the kubelet writes the downward-API files (``labels``, ``annotations``: sorted
``key="value"`` lines, Go-quoted values), and ``python -m sidecar config`` runs with the
sidecar container's own args (its ``--podinfo-dir`` pointed at those files) and env (the
``status.podIP`` field reference given a fixed address). The printed settings must name the
engine, KV connector, role, engine URL (from the port label), SGLang bootstrap port and prefill
pod selector the manifest intends, each from the source the manifest means to set it (label,
annotation or env), with no warnings.

Does not prove: that the kubelet really writes these exact bytes (tests/config covers the
parser against the kubelet's format), or anything about serving.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("yaml", reason="pip install pyyaml")

from deploy_render import OVERLAYS, Obj, render_overlay

REPO = Path(__file__).resolve().parents[2]
POD_IP = "10.1.2.3"
PREFILL_SELECTOR = "app.kubernetes.io/name=disagg-pd,role-name=prefill"

# What each overlay's pods mean: (engine, connector, engine port, bootstrap port or None).
INTENDED: dict[str, tuple[str, str, int, int | None]] = {
    "vllm": ("vllm", "shfs", 8000, None),
    "sglang": ("sglang", "shfs", 30000, 8998),
    "trtllm": ("trtllm", "shfs", 8000, None),
    "vllm-nixl-push": ("vllm", "nixl-push", 8000, None),
}
#: What the kubelet gives a ``metadata.name`` field reference (the pod's name).
POD_NAME = "pd-prefill-7d9f8-abcde"


def go_quote(value: str) -> str:
    """Go's %q of a printable-ASCII string, as the kubelet writes label values."""
    if not all(" " <= ch <= "~" for ch in value):
        raise ValueError(f"non-printable value {value!r}: extend go_quote before using it")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def downward_file(mapping: dict[str, str]) -> str:
    return "\n".join(f"{key}={go_quote(str(mapping[key]))}" for key in sorted(mapping))


def sidecar_of(deployment: Obj) -> Obj:
    containers: list[Obj] = deployment["spec"]["template"]["spec"]["containers"]
    (ctr,) = [c for c in containers if c["name"] == "sidecar"]
    return ctr


def container_env(ctr: Obj) -> dict[str, str]:
    """The container's env as the kubelet would set it, with field references resolved."""
    env: dict[str, str] = {}
    for entry in ctr.get("env", []):
        if "value" in entry:
            env[entry["name"]] = str(entry["value"])
        elif entry["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}:
            env[entry["name"]] = POD_IP
        elif entry["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}:
            env[entry["name"]] = POD_NAME
        else:
            raise AssertionError(f"unmodelled env source {entry!r}")
    return env


def config_argv(ctr: Obj, podinfo_dir: Path) -> list[str]:
    """The container's args for `config` instead of `serve`, reading pod info from the test."""
    args = [str(a) for a in ctr["args"]]
    assert args[0] == "serve"
    i = args.index("--podinfo-dir")
    args[i + 1] = str(podinfo_dir)
    return ["config", *args[1:]]


def clean_environ() -> dict[str, str]:
    """This process's environment without anything that would configure the sidecar."""
    return {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_") and k != "POD_IP"}


def run_config(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture(scope="module")
def config_command() -> None:
    """The CLI answers and has its ``config`` subcommand (a missing one fails the tests)."""
    proc = run_config(["--help"], clean_environ())
    assert proc.returncode == 0, f"`python -m sidecar --help` failed:\n{proc.stderr[-2000:]}"
    assert "config" in proc.stdout, "the sidecar CLI has no `config` subcommand"


def cases() -> list[tuple[str, str]]:
    return [(overlay, role) for overlay in OVERLAYS for role in ("prefill", "decode")]


@pytest.mark.usefixtures("config_command")
@pytest.mark.parametrize(("overlay", "role"), cases())
def test_manifest_labels_resolve_intended_settings(overlay: str, role: str, tmp_path: Path) -> None:
    deps = {o["metadata"]["name"]: o for o in render_overlay(overlay) if o["kind"] == "Deployment"}
    deployment = deps[f"pd-{role}"]
    meta = deployment["spec"]["template"]["metadata"]
    (tmp_path / "labels").write_text(downward_file(meta.get("labels", {})), encoding="utf-8")
    (tmp_path / "annotations").write_text(
        downward_file(meta.get("annotations", {})), encoding="utf-8"
    )
    ctr = sidecar_of(deployment)
    proc = run_config(config_argv(ctr, tmp_path), {**clean_environ(), **container_env(ctr)})
    assert proc.returncode == 0, proc.stderr
    report: dict[str, Any] = json.loads(proc.stdout)
    settings = {name: entry["value"] for name, entry in report["settings"].items()}
    sources = {name: entry["source"] for name, entry in report["settings"].items()}

    engine, connector, port, bootstrap = INTENDED[overlay]
    assert settings["engine"] == engine
    assert sources["engine"] == "label model.aibrix.ai/engine"
    assert settings["role"] == role
    assert sources["role"] == "label role-name"
    assert settings["engine_url"] == f"http://127.0.0.1:{port}"
    assert sources["engine_url"] == "label model.aibrix.ai/port"
    assert settings["kv_connector"] == connector
    if overlay in ("vllm", "vllm-nixl-push"):
        assert sources["kv_connector"] == "label model.aibrix.ai/kv-connector-type"
    if overlay == "vllm-nixl-push" and role == "prefill":
        # Its own engine's identity: gRPC Prefill hands off at once.
        assert settings["nixl_push_engine_id"] == POD_NAME
        assert sources["nixl_push_engine_id"] == "env DISAGG_NIXL_PUSH_ENGINE_ID"
    else:
        assert settings.get("nixl_push_engine_id") is None
    if bootstrap is not None:
        assert settings["sglang_bootstrap_port"] == bootstrap
        assert (
            sources["sglang_bootstrap_port"] == "annotation model.aibrix.ai/sglang-bootstrap-port"
        )
    assert settings["advertise_host"] == POD_IP
    assert sources["advertise_host"] == "env POD_IP"
    assert settings["port"] == 8080
    assert settings["grpc_port"] == 50051
    assert settings["prefill_allowlist"] == []
    if role == "decode":
        assert settings["prefill_pod_selector"] == PREFILL_SELECTOR
        assert sources["prefill_pod_selector"] == "env DISAGG_PREFILL_POD_SELECTOR"
    else:
        assert settings["prefill_pod_selector"] is None
    assert report["warnings"] == []
