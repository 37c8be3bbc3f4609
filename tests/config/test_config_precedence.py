"""Proves the four layers stack as documented: flag > env DISAGG_* > pod label/annotation > default.

Each field a label can set is checked at every layer, with its source; plain fields are checked
for flag > env > default; label key names are themselves configurable; POD_IP backs
advertise_host. Not covered here: fallbacks and refusals (their own modules).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from config_builders import FIXTURES, load, write_podinfo

from sidecar.config.settings import PrefillFailurePolicy, Role


@pytest.fixture
def pod(tmp_path: Path) -> Path:
    return write_podinfo(
        tmp_path / "podinfo",
        labels={
            "model.aibrix.ai/engine": "sglang",
            "model.aibrix.ai/kv-connector-type": "mooncake",
            "model.aibrix.ai/port": "8200",
            "role-name": "prefill",
        },
        annotations={"model.aibrix.ai/sglang-bootstrap-port": "9100"},
    )


def test_defaults_without_anything() -> None:
    loaded = load()
    s = loaded.settings
    assert (s.engine, s.kv_connector, s.engine_url, s.role) == (
        "vllm", "shfs", "http://127.0.0.1:8000", Role.BOTH,
    )
    assert s.sglang_bootstrap_port == 8998
    assert set(loaded.sources.values()) == {"default"}
    assert loaded.warnings == ()


def test_labels_override_defaults(pod: Path) -> None:
    loaded = load(podinfo=pod)
    s = loaded.settings
    assert s.engine == "sglang"
    assert s.kv_connector == "mooncake"
    assert s.engine_url == "http://127.0.0.1:8200"
    assert s.role is Role.PREFILL
    assert s.sglang_bootstrap_port == 9100
    assert loaded.sources["engine"] == "label model.aibrix.ai/engine"
    assert loaded.sources["kv_connector"] == "label model.aibrix.ai/kv-connector-type"
    assert loaded.sources["engine_url"] == "label model.aibrix.ai/port"
    assert loaded.sources["role"] == "label role-name"
    assert loaded.sources["sglang_bootstrap_port"] == (
        "annotation model.aibrix.ai/sglang-bootstrap-port"
    )
    assert loaded.sources["podinfo_dir"] == "flag --podinfo-dir"


def test_env_overrides_labels(pod: Path) -> None:
    env = {
        "DISAGG_ENGINE": "vllm",
        "DISAGG_KV_CONNECTOR": "nixl",
        "DISAGG_ENGINE_URL": "http://engine:9000",
        "DISAGG_ROLE": "decode",
        "DISAGG_SGLANG_BOOTSTRAP_PORT": "9200",
    }
    loaded = load(env=env, podinfo=pod)
    s = loaded.settings
    assert (s.engine, s.kv_connector, s.engine_url, s.role, s.sglang_bootstrap_port) == (
        "vllm", "nixl", "http://engine:9000", Role.DECODE, 9200,
    )
    for name in ("engine", "kv_connector", "engine_url", "role", "sglang_bootstrap_port"):
        assert loaded.sources[name] == f"env DISAGG_{name.upper()}"


def test_flags_override_env_and_labels(pod: Path) -> None:
    env = {
        "DISAGG_ENGINE": "sglang",
        "DISAGG_KV_CONNECTOR": "mooncake",
        "DISAGG_ENGINE_URL": "http://engine:9000",
        "DISAGG_ROLE": "decode",
        "DISAGG_SGLANG_BOOTSTRAP_PORT": "9200",
    }
    argv = [
        "--engine", "vllm",
        "--kv-connector", "SHFS",
        "--engine-url", "https://other:9443/",
        "--role", "both",
        "--sglang-bootstrap-port", "9300",
    ]
    loaded = load(argv, env, podinfo=pod)
    s = loaded.settings
    assert (s.engine, s.kv_connector, s.engine_url, s.role, s.sglang_bootstrap_port) == (
        "vllm", "shfs", "https://other:9443", Role.BOTH, 9300,
    )
    assert loaded.sources["engine_url"] == "flag --engine-url"
    assert loaded.sources["sglang_bootstrap_port"] == "flag --sglang-bootstrap-port"


@pytest.mark.parametrize(
    ("name", "flag", "flag_value", "env_value", "expected_flag", "expected_env", "default"),
    [
        ("port", "--port", "9001", "9002", 9001, 9002, 8080),
        ("grpc_port", "--grpc-port", "0", "7000", 0, 7000, 50051),
        ("trtllm_machine_id", "--trtllm-machine-id", "5", "1023", 5, 1023, 0),
        ("prefill_timeout_s", "--prefill-timeout-s", "1.5", "2", 1.5, 2.0, 30.0),
        ("on_prefill_failure", "--on-prefill-failure", "local", "fail",
         PrefillFailurePolicy.LOCAL, PrefillFailurePolicy.FAIL, PrefillFailurePolicy.FAIL),
        ("log_level", "--log-level", "DEBUG", "warning", "debug", "warning", "info"),
        ("metrics_port", "--metrics-port", "9090", "9091", 9090, 9091, None),
    ],
)
def test_plain_fields_flag_over_env_over_default(
    name: str, flag: str, flag_value: str, env_value: str,
    expected_flag: object, expected_env: object, default: object,
) -> None:
    env = {f"DISAGG_{name.upper()}": env_value}
    assert getattr(load().settings, name) == default
    from_env = load(env=env)
    assert getattr(from_env.settings, name) == expected_env
    assert from_env.sources[name] == f"env DISAGG_{name.upper()}"
    from_flag = load([flag, flag_value], env)
    assert getattr(from_flag.settings, name) == expected_flag
    assert from_flag.sources[name] == f"flag {flag}"


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], {}, True),
        ([], {"DISAGG_GRPC_ENABLED": "no"}, False),
        ([], {"DISAGG_GRPC_ENABLED": "0"}, False),
        ([], {"DISAGG_GRPC_ENABLED": "FALSE"}, False),
        (["--grpc"], {"DISAGG_GRPC_ENABLED": "false"}, True),
        (["--no-grpc"], {"DISAGG_GRPC_ENABLED": "yes"}, False),
    ],
)
def test_boolean_flag_and_env(argv: list[str], env: dict[str, str], expected: bool) -> None:
    assert load(argv, env).settings.grpc_enabled is expected


def test_trusted_router_boolean() -> None:
    assert load(["--trusted-router"]).settings.trusted_router is True
    assert load(env={"DISAGG_TRUSTED_ROUTER": "1"}).settings.trusted_router is True
    loaded = load(["--no-trusted-router"], {"DISAGG_TRUSTED_ROUTER": "1"})
    assert loaded.settings.trusted_router is False


def test_list_fields() -> None:
    env = {
        "DISAGG_PREFILL_URLS": "http://p0:8000, http://p1:8000",
        "DISAGG_PREFILL_ALLOWLIST": "10.0.0.0/8:*,prefill.svc:8000",
    }
    loaded = load(env=env)
    assert loaded.settings.prefill_urls == ("http://p0:8000", "http://p1:8000")
    assert loaded.settings.prefill_allowlist == ("10.0.0.0/8:*", "prefill.svc:8000")
    argv = ["--prefill-url", "http://a:1", "--prefill-url", "http://b:2,https://[fd00::1]:3",
            "--prefill-allowlist", "[fd00::/8]:*", "--prefill-allowlist", "p:1,q:2"]
    loaded = load(argv, env)
    assert loaded.settings.prefill_urls == ("http://a:1", "http://b:2", "https://[fd00::1]:3")
    assert loaded.settings.prefill_allowlist == ("[fd00::/8]:*", "p:1", "q:2")
    assert loaded.sources["prefill_urls"] == "flag --prefill-url"


def test_advertise_host_falls_back_to_pod_ip() -> None:
    assert load().settings.advertise_host is None
    loaded = load(env={"POD_IP": "10.1.2.3"})
    assert loaded.settings.advertise_host == "10.1.2.3"
    assert loaded.sources["advertise_host"] == "env POD_IP"
    loaded = load(env={"POD_IP": "10.1.2.3", "DISAGG_ADVERTISE_HOST": "pod.svc"})
    assert loaded.settings.advertise_host == "pod.svc"
    loaded = load(["--advertise-host", "flag.svc"], {"DISAGG_ADVERTISE_HOST": "pod.svc"})
    assert loaded.settings.advertise_host == "flag.svc"


def test_empty_env_counts_as_unset() -> None:
    loaded = load(env={"DISAGG_ENGINE": "", "DISAGG_METRICS_PORT": " ", "POD_IP": ""})
    assert loaded.settings.engine == "vllm"
    assert loaded.settings.metrics_port is None
    assert loaded.settings.advertise_host is None
    assert loaded.sources["engine"] == "default"


def test_podinfo_dir_from_env() -> None:
    loaded = load(env={"DISAGG_PODINFO_DIR": str(FIXTURES / "aibrix-decode")})
    assert loaded.settings.engine_url == "http://127.0.0.1:8200"
    assert loaded.settings.kv_connector == "nixl"  # label "NIXL", case-insensitive
    assert loaded.settings.role is Role.DECODE
    assert loaded.settings.sglang_bootstrap_port == 9001
    assert loaded.sources["podinfo_dir"] == "env DISAGG_PODINFO_DIR"


def test_label_keys_are_configurable(tmp_path: Path) -> None:
    pod = write_podinfo(
        tmp_path,
        labels={"llm-d.ai/role": "decode", "my/engine": "trtllm", "my/port": "8300",
                "role-name": "prefill", "model.aibrix.ai/engine": "sglang"},
        annotations={"my/bootstrap": "9400"},
    )
    argv = ["--role-label", "llm-d.ai/role", "--engine-label", "my/engine",
            "--port-label", "my/port", "--sglang-bootstrap-port-annotation", "my/bootstrap"]
    loaded = load(argv, podinfo=pod)
    s = loaded.settings
    assert (s.role, s.engine, s.engine_url, s.sglang_bootstrap_port) == (
        Role.DECODE, "trtllm", "http://127.0.0.1:8300", 9400,
    )
    assert loaded.sources["role"] == "label llm-d.ai/role"
    loaded = load(env={"DISAGG_ROLE_LABEL": "llm-d.ai/role"}, podinfo=pod)
    assert loaded.settings.role is Role.DECODE


def test_escaped_label_values_reach_settings(tmp_path: Path) -> None:
    pod = write_podinfo(tmp_path, labels={"role-name": "decode"},
                        annotations={"model.aibrix.ai/sglang-bootstrap-port": "9500",
                                     "other": 'x"\\\n\u200b'})
    assert load(podinfo=pod).settings.sglang_bootstrap_port == 9500
