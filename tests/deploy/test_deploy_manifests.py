"""The deploy/ manifests are valid Kubernetes objects and hang together.

Proves: every manifest file and every overlay's rendered output passes strict schema
validation (unknown fields rejected) for the oldest supported Kubernetes (1.30, for the
preStop ``sleep`` action) and the newest schema kubernetes-validate ships; the offline renderer
matches ``kubectl kustomize`` where kubectl exists; each Deployment pairs an engine with a
sidecar that reads the downward-API files, is probed on /ready and /health, and runs non-root;
labels, annotations, engine flags, ports, the Service, the NetworkPolicies, the RBAC and the
Dockerfile agree with one another.

Does not prove: that a cluster accepts them (no API server here; admission webhooks and
CNI-specific NetworkPolicy behaviour are not modelled), or that the engine images and flags
start real engines (no GPUs here).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

# Test dependencies (pyproject's test extras); a missing one shows as a skip reason under -ra.
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="pip install kubernetes-validate"
)
yaml = pytest.importorskip("yaml", reason="pip install pyyaml")

from deploy_render import (  # noqa: E402 (after the dependency checks)
    DEPLOY_DIR,
    OVERLAYS,
    Obj,
    RenderError,
    apply_json_patch,
    by_kind_name,
    load_documents,
    render_overlay,
)

MIN_K8S = "1.30.0"
K8S_VERSIONS = (MIN_K8S, kubernetes_validate.latest_version())
ENGINE_LABEL = "model.aibrix.ai/engine"
CONNECTOR_LABEL = "model.aibrix.ai/kv-connector-type"
PORT_LABEL = "model.aibrix.ai/port"
ROLE_LABEL = "role-name"
BOOTSTRAP_ANNOTATION = "model.aibrix.ai/sglang-bootstrap-port"
ENGINE_PORTS = {"vllm": 8000, "sglang": 30000, "trtllm": 8000}
#: Each overlay's engine label value (an overlay named engine-connector runs that engine).
VLLM_OVERLAYS = ("vllm", "vllm-nixl-push")


def engine_of(overlay: str) -> str:
    return "vllm" if overlay in VLLM_OVERLAYS else overlay
DOCKERFILE = DEPLOY_DIR.parent / "Dockerfile"


def manifest_files() -> list[Path]:
    """deploy/ files holding Kubernetes objects (not kustomizations, not JSON patches)."""
    out = []
    for path in sorted(DEPLOY_DIR.rglob("*.yaml")):
        docs = load_documents(path)
        if path.name != "kustomization.yaml" and docs and all(isinstance(d, dict) for d in docs):
            out.append(path)
    return out


def deployments(objects: list[Obj]) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}


def container(deployment: Obj, name: str) -> Obj:
    found = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    assert len(found) == 1, f"{deployment['metadata']['name']}: want one container {name!r}"
    ctr: Obj = found[0]
    return ctr


def engine_flag(engine: Obj, flag: str) -> str | None:
    """The value of ``--flag=value`` (or ``--flag value``) in the engine's args."""
    args = [str(a) for a in engine.get("args", [])]
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
    return None


def env_value(ctr: Obj, name: str) -> Any:
    for entry in ctr.get("env", []):
        if entry["name"] == name:
            return entry.get("value", entry.get("valueFrom"))
    return None


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(DEPLOY_DIR)))
def test_manifest_file_is_valid(path: Path, version: str) -> None:
    for doc in load_documents(path):
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_overlay_is_valid(overlay: str, version: str) -> None:
    objects = render_overlay(overlay)
    by_kind_name(objects)  # no duplicates
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_strict_validation_rejects_unknown_fields() -> None:
    """Guards the tests above against a validator that accepts anything."""
    service = load_documents(DEPLOY_DIR / "base" / "decode-service.yaml")[0]
    service["spec"]["ports"][0]["targetPortt"] = "http"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, MIN_K8S, strict=True)


def test_json_patch_test_guard_fails_loudly() -> None:
    doc: Obj = {"a": [{"name": "engine"}]}
    with pytest.raises(RenderError):
        apply_json_patch(doc, [{"op": "test", "path": "/a/0/name", "value": "sidecar"}])
    assert apply_json_patch(doc, [{"op": "add", "path": "/a/-", "value": 1}]) == {
        "a": [{"name": "engine"}, 1]
    }
    assert doc == {"a": [{"name": "engine"}]}  # the input is never mutated


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renderer_matches_kubectl_kustomize(overlay: str) -> None:
    proc = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY_DIR / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    theirs = [d for d in yaml.safe_load_all(proc.stdout) if d is not None]
    assert by_kind_name(theirs) == by_kind_name(render_overlay(overlay))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_pair_engine_and_sidecar(overlay: str) -> None:
    deps = deployments(render_overlay(overlay))
    assert set(deps) == {"pd-prefill", "pd-decode"}
    for name, dep in deps.items():
        template = dep["spec"]["template"]
        labels = template["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        assert labels[ENGINE_LABEL] == engine_of(overlay), name
        assert labels[ROLE_LABEL] == name.removeprefix("pd-"), name
        assert labels[PORT_LABEL] == str(ENGINE_PORTS[engine_of(overlay)]), name
        # Connectors are a vLLM notion: only vLLM pods carry the label.
        assert (CONNECTOR_LABEL in labels) == (overlay in VLLM_OVERLAYS), name

        engine = container(dep, "engine")
        sidecar = container(dep, "sidecar")
        engine_ports = {p["containerPort"] for p in engine["ports"]}
        assert int(labels[PORT_LABEL]) in engine_ports, f"{name}: port label is not an engine port"
        assert engine_flag(engine, "--port") == labels[PORT_LABEL], name

        # The sidecar reads the pod's labels and annotations from the downward-API volume.
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        items = {
            i["path"]: i["fieldRef"]["fieldPath"]
            for i in volumes["podinfo"]["downwardAPI"]["items"]
        }
        assert items == {"labels": "metadata.labels", "annotations": "metadata.annotations"}
        mounts = {m["name"]: m for m in sidecar["volumeMounts"]}
        assert mounts["podinfo"]["readOnly"] is True
        args = sidecar["args"]
        assert args[0] == "serve"
        assert args[args.index("--podinfo-dir") + 1] == mounts["podinfo"]["mountPath"]

        sidecar_ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
        assert sidecar_ports == {"http": 8080, "grpc": 50051}
        assert not set(sidecar_ports.values()) & engine_ports, f"{name}: port clash in the pod"
        assert sidecar["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
        assert sidecar["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        security = sidecar["securityContext"]
        assert security["runAsNonRoot"] is True
        assert security["allowPrivilegeEscalation"] is False
        assert security["readOnlyRootFilesystem"] is True
        assert security["capabilities"]["drop"] == ["ALL"]
        assert env_value(sidecar, "POD_IP") == {"fieldRef": {"fieldPath": "status.podIP"}}


@pytest.mark.parametrize("overlay", VLLM_OVERLAYS)
def test_vllm_engines_serve_every_pd_route(overlay: str) -> None:
    # /inference/v1/generate exists in vLLM 0.32 only with --enable-scale-out (else 403).
    for name, dep in deployments(render_overlay(overlay)).items():
        engine = container(dep, "engine")
        assert "--enable-scale-out" in engine["args"], name
        version = engine["image"].rsplit(":v", 1)[1]
        assert tuple(int(p) for p in version.split(".")[:2]) >= (0, 32), name


def test_vllm_decode_engine_publishes_kv_events_to_its_sidecar() -> None:
    """The decode engine's --kv-events-config names the sidecar's --kv-events-endpoint and
    topic (a non-wildcard TCP address: the engine connects, the sidecar binds), with prefix
    caching on, and the sidecar's cache rule is on (the index alone places nothing); the
    prefill side has neither."""
    deps = deployments(render_overlay("vllm"))
    decode = deps["pd-decode"]
    engine = container(decode, "engine")
    config = json.loads(engine_flag(engine, "--kv-events-config"))
    assert config["enable_kv_cache_events"] is True and config["publisher"] == "zmq"
    assert "--enable-prefix-caching" in engine["args"]
    sidecar = container(decode, "sidecar")
    assert engine_flag(sidecar, "--kv-events-endpoint") == config["endpoint"]
    assert engine_flag(sidecar, "--kv-events-topic") == config["topic"]
    assert int(engine_flag(sidecar, "--local-prefill-max-uncached-tokens")) > 0
    assert config["endpoint"].startswith("tcp://127.0.0.1:")
    prefill = deps["pd-prefill"]
    for ctr in prefill["spec"]["template"]["spec"]["containers"]:
        assert not any("kv-events" in str(arg) for arg in ctr.get("args", [])), ctr["name"]


def test_nixl_push_engines_and_sidecars_agree() -> None:
    deps = deployments(render_overlay("vllm-nixl-push"))
    pod_name = {"fieldRef": {"fieldPath": "metadata.name"}}
    for name, dep in deps.items():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert labels[CONNECTOR_LABEL] == "nixl-push", name
        engine = container(dep, "engine")
        config = json.loads(engine_flag(engine, "--kv-transfer-config") or "{}")
        assert config["kv_connector"] == "NixlPushConnector", name
        role = labels[ROLE_LABEL]
        assert config["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
        # Both engines need their NIXL side channel: the prefill connects back to the decode.
        assert env_value(engine, "VLLM_NIXL_SIDE_CHANNEL_HOST") == {
            "fieldRef": {"fieldPath": "status.podIP"}}
        sidecar = container(dep, "sidecar")
        if role == "prefill":
            # A unique engine id per pod, which its sidecar knows (gRPC Prefill at once).
            assert config["engine_id"] == "$(POD_NAME)"
            assert env_value(engine, "POD_NAME") == pod_name
            assert env_value(sidecar, "DISAGG_NIXL_PUSH_ENGINE_ID") == pod_name
        else:
            assert "engine_id" not in config
            assert env_value(sidecar, "DISAGG_NIXL_PUSH_ENGINE_ID") is None


def test_sglang_roles_and_bootstrap_port_agree() -> None:
    deps = deployments(render_overlay("sglang"))
    for name, dep in deps.items():
        engine = container(dep, "engine")
        role = dep["spec"]["template"]["metadata"]["labels"][ROLE_LABEL]
        assert engine_flag(engine, "--disaggregation-mode") == role, name
        annotation = dep["spec"]["template"]["metadata"]["annotations"][BOOTSTRAP_ANNOTATION]
        # Both sides carry the PREFILL engine's bootstrap port: decode sends it as bootstrap_port.
        prefill_engine = container(deps["pd-prefill"], "engine")
        assert annotation == engine_flag(prefill_engine, "--disaggregation-bootstrap-port"), name
    bootstrap = {
        p["name"]: p["containerPort"] for p in container(deps["pd-prefill"], "engine")["ports"]
    }
    assert (
        str(bootstrap["bootstrap"])
        == deps["pd-prefill"]["spec"]["template"]["metadata"]["annotations"][BOOTSTRAP_ANNOTATION]
    )


def test_trtllm_engines_read_their_options_file() -> None:
    objects = by_kind_name(render_overlay("trtllm"))
    options = objects[("ConfigMap", "pd-trtllm-options")]["data"]
    for name, want in (("pd-prefill", "context.yaml"), ("pd-decode", "generation.yaml")):
        dep = objects[("Deployment", name)]
        engine = container(dep, "engine")
        path = engine_flag(engine, "--extra_llm_api_options")
        assert path is not None and Path(path).name == want, name
        mount = {m["name"]: m["mountPath"] for m in engine["volumeMounts"]}["trtllm-options"]
        assert str(Path(path).parent) == mount, name
        volume = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}[
            "trtllm-options"
        ]
        assert volume["configMap"]["name"] == "pd-trtllm-options"
        assert "cache_transceiver_config" in options[want]


def parse_selector(text: str) -> dict[str, str]:
    """An equality-only label selector ("a=b,c=d") as a dict; anything else fails the test."""
    pairs = [item.split("=") for item in text.split(",")]
    assert all(len(pair) == 2 and pair[0] and pair[1] for pair in pairs), text
    return {key.strip(): value.strip() for key, value in pairs}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_decode_allowlist_selects_exactly_the_prefill_pods(overlay: str) -> None:
    """Kubernetes mode: the selector names the prefill pods, never the decode pods."""
    deps = deployments(render_overlay(overlay))
    decode_sidecar = container(deps["pd-decode"], "sidecar")
    selector = env_value(decode_sidecar, "DISAGG_PREFILL_POD_SELECTOR")
    assert isinstance(selector, str)
    wanted = parse_selector(selector).items()
    assert wanted <= deps["pd-prefill"]["spec"]["template"]["metadata"]["labels"].items()
    assert not wanted <= deps["pd-decode"]["spec"]["template"]["metadata"]["labels"].items()
    # The pod set is the only allowlist: no static rule widens it.
    assert env_value(decode_sidecar, "DISAGG_PREFILL_ALLOWLIST") is None
    prefill_sidecar = container(deps["pd-prefill"], "sidecar")
    assert env_value(prefill_sidecar, "DISAGG_PREFILL_POD_SELECTOR") is None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_targets_decode_sidecars_only(overlay: str) -> None:
    objects = by_kind_name(render_overlay(overlay))
    service = objects[("Service", "pd-decode")]
    selector = service["spec"]["selector"].items()
    decode_labels = objects[("Deployment", "pd-decode")]["spec"]["template"]["metadata"]["labels"]
    prefill_labels = objects[("Deployment", "pd-prefill")]["spec"]["template"]["metadata"]["labels"]
    assert selector <= decode_labels.items()
    assert not selector <= prefill_labels.items()
    sidecar_ports = {
        p["name"] for p in container(objects[("Deployment", "pd-decode")], "sidecar")["ports"]
    }
    assert {p["targetPort"] for p in service["spec"]["ports"]} == sidecar_ports


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies(overlay: str) -> None:
    objects = by_kind_name(render_overlay(overlay))
    deps = deployments(list(objects.values()))
    for role in ("prefill", "decode"):
        policy = objects[("NetworkPolicy", f"pd-{role}-ingress")]
        labels = deps[f"pd-{role}"]["spec"]["template"]["metadata"]["labels"]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
        assert policy["spec"]["policyTypes"] == ["Ingress"]

    def rule_from(policy: Obj, label: str, value: str) -> Obj:
        rules = [
            r
            for r in policy["spec"]["ingress"]
            if any(
                p.get("podSelector", {}).get("matchLabels", {}).get(label) == value
                for p in r["from"]
            )
        ]
        assert len(rules) == 1
        rule: Obj = rules[0]
        return rule

    decode_policy = objects[("NetworkPolicy", "pd-decode-ingress")]
    router = rule_from(decode_policy, "app.kubernetes.io/component", "router")
    assert {p["port"] for p in router["ports"]} == {8080, 50051}
    prefill_policy = objects[("NetworkPolicy", "pd-prefill-ingress")]
    assert {
        p["port"]
        for p in rule_from(prefill_policy, "app.kubernetes.io/component", "router")["ports"]
    } == {50051}
    from_decode = rule_from(prefill_policy, ROLE_LABEL, "decode")
    if overlay == "vllm-nixl-push":
        # Push: the prefill engine reaches the decode engine's side channel, and only that.
        from_prefill = rule_from(decode_policy, ROLE_LABEL, "prefill")
        engine = container(deps["pd-decode"], "engine")
        assert {p["port"] for p in from_prefill["ports"]} == {
            int(env_value(engine, "VLLM_NIXL_SIDE_CHANNEL_PORT"))}
    if overlay in VLLM_OVERLAYS:
        # Only the prefill leg (engine HTTP) and the NIXL side channel.
        engine = container(deps["pd-prefill"], "engine")
        assert {p["port"] for p in from_decode["ports"]} == {
            int(engine_flag(engine, "--port") or 0),
            int(env_value(engine, "VLLM_NIXL_SIDE_CHANNEL_PORT")),
        }
    else:
        # SGLang and TensorRT-LLM move KV on ports chosen at run time.
        assert "ports" not in from_decode


def test_rbac_reads_pods_only_for_the_pods_account() -> None:
    objects = by_kind_name(render_overlay("vllm"))
    role = objects[("Role", "disagg-sidecar-pod-reader")]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    binding = objects[("RoleBinding", "disagg-sidecar-pod-reader")]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "disagg-sidecar-pod-reader",
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "disagg-sidecar"}]
    assert ("ServiceAccount", "disagg-sidecar") in objects
    for dep in deployments(list(objects.values())).values():
        assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "disagg-sidecar"


def test_dockerfile_matches_the_sidecar_container() -> None:
    """The image exposes the ports the manifests name and runs as the UID they require."""
    text = DOCKERFILE.read_text(encoding="utf-8")
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", text, re.M) for p in line.split()}
    user = re.findall(r"^USER (\d+):(\d+)$", text, re.M)
    sidecar = container(deployments(render_overlay("vllm"))["pd-decode"], "sidecar")
    assert {p["containerPort"] for p in sidecar["ports"]} <= exposed
    assert user[-1] == (
        str(sidecar["securityContext"]["runAsUser"]),
        str(sidecar["securityContext"]["runAsGroup"]),
    )
