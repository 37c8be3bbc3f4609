"""Proves every fallback the label rules allow, and the warnings they raise (exactly once).

Covered: missing engine label -> vllm; an unregistered engine name kept only with
``--allow-unregistered-engine`` (refused otherwise, whatever its source); a missing or
unknown connector label -> default_kv_connector with one warning, for vLLM only;
a label connector for an engine its agent does not serve is not refused; role labels other
than prefill/decode -> both; missing label files; a missing podinfo directory; no podinfo at
all (no warnings). Not covered: refusals (test_config_refusals).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from config_builders import load, write_podinfo

from sidecar.config.checks import ConfigError
from sidecar.config.settings import Role

CONNECTOR_LABEL = "model.aibrix.ai/kv-connector-type"


def test_missing_engine_label_means_vllm(tmp_path: Path) -> None:
    pod = write_podinfo(tmp_path, labels={CONNECTOR_LABEL: "nixl"})
    loaded = load(podinfo=pod)
    assert loaded.settings.engine == "vllm"
    assert loaded.sources["engine"] == "default"
    assert loaded.warnings == ()


def test_empty_engine_label_means_vllm(tmp_path: Path) -> None:
    pod = write_podinfo(tmp_path, labels={"model.aibrix.ai/engine": " ", CONNECTOR_LABEL: "shfs"})
    assert load(podinfo=pod).settings.engine == "vllm"


def test_engine_label_is_lowercased(tmp_path: Path) -> None:
    pod = write_podinfo(tmp_path, labels={"model.aibrix.ai/engine": "SGLang"})
    assert load(podinfo=pod).settings.engine == "sglang"


@pytest.mark.parametrize("how", ["label", "flag", "env"])
def test_unregistered_engine_is_refused_unless_the_default_dialect_is_asked_for(
        tmp_path: Path, how: str) -> None:
    pod = write_podinfo(tmp_path, labels={"model.aibrix.ai/engine": "lmdeploy"})
    argv = ["--engine", "lmdeploy"] if how == "flag" else []
    env = {"DISAGG_ENGINE": "lmdeploy"} if how == "env" else {}
    podinfo = pod if how == "label" else None
    with pytest.raises(ConfigError, match=r"'lmdeploy' \(from .*\) is not registered"):
        load(argv, env, podinfo=podinfo)
    loaded = load([*argv, "--allow-unregistered-engine"], env, podinfo=podinfo)
    assert loaded.settings.engine == "lmdeploy"
    assert loaded.warnings == ()


def test_missing_connector_label_falls_back_with_one_warning(tmp_path: Path) -> None:
    pod = write_podinfo(tmp_path, labels={"model.aibrix.ai/engine": "vllm"})
    loaded = load(podinfo=pod)
    assert loaded.settings.kv_connector == "shfs"
    assert loaded.sources["kv_connector"] == "default"
    assert len(loaded.warnings) == 1
    assert CONNECTOR_LABEL in loaded.warnings[0]


def test_unknown_connector_label_falls_back_to_configured_default(tmp_path: Path) -> None:
    pod = write_podinfo(tmp_path, labels={CONNECTOR_LABEL: "lmcache"})
    loaded = load(["--default-kv-connector", "Mooncake"], podinfo=pod)
    assert loaded.settings.kv_connector == "mooncake"
    assert loaded.settings.default_kv_connector == "mooncake"
    assert loaded.sources["kv_connector"] == "default_kv_connector (flag --default-kv-connector)"
    assert len(loaded.warnings) == 1
    warning = loaded.warnings[0]
    assert "'lmcache'" in warning and "mooncake, nixl, nixl-push, shfs" in warning


def test_connector_label_case_insensitive(tmp_path: Path) -> None:
    pod = write_podinfo(tmp_path, labels={CONNECTOR_LABEL: " MoonCake "})
    loaded = load(podinfo=pod)
    assert loaded.settings.kv_connector == "mooncake"
    assert loaded.warnings == ()


@pytest.mark.parametrize("engine", ["sglang", "trtllm"])
def test_no_connector_warning_for_other_engines(tmp_path: Path, engine: str) -> None:
    pod = write_podinfo(tmp_path, labels={"model.aibrix.ai/engine": engine,
                                          CONNECTOR_LABEL: "bogus"})
    loaded = load(podinfo=pod)
    assert loaded.settings.kv_connector == "shfs"
    assert loaded.warnings == ()


def test_label_connector_for_other_engine_is_not_refused(tmp_path: Path) -> None:
    # A label only applies where it is meaningful; an explicit flag would be refused.
    pod = write_podinfo(tmp_path, labels={"model.aibrix.ai/engine": "sglang",
                                          CONNECTOR_LABEL: "nixl"})
    assert load(podinfo=pod).settings.kv_connector == "nixl"


@pytest.mark.parametrize(
    ("label", "role"),
    [("prefill", Role.PREFILL), ("decode", Role.DECODE), ("Decode", Role.DECODE),
     ("worker", Role.BOTH), ("", Role.BOTH), ("both", Role.BOTH)],
)
def test_role_label(tmp_path: Path, label: str, role: Role) -> None:
    pod = write_podinfo(tmp_path, labels={"role-name": label, CONNECTOR_LABEL: "shfs"})
    loaded = load(podinfo=pod)
    assert loaded.settings.role is role
    assert loaded.sources["role"] == "label role-name"
    # A value that is no role is served as both, and said (issue #29); an empty one is unset.
    assert len(loaded.warnings) == (label == "worker")


def test_missing_files_fall_back_to_defaults(tmp_path: Path) -> None:
    loaded = load(podinfo=tmp_path)  # exists, but holds neither file
    s = loaded.settings
    assert (s.engine, s.kv_connector, s.engine_url, s.role, s.sglang_bootstrap_port) == (
        "vllm", "shfs", "http://127.0.0.1:8000", Role.BOTH, 8998,
    )
    assert len(loaded.warnings) == 1  # the missing connector label, once


def test_only_annotations_file(tmp_path: Path) -> None:
    pod = write_podinfo(tmp_path, annotations={"model.aibrix.ai/sglang-bootstrap-port": "7000"})
    loaded = load(podinfo=pod)
    assert loaded.settings.sglang_bootstrap_port == 7000


def test_missing_podinfo_directory_warns_once(tmp_path: Path) -> None:
    loaded = load(podinfo=tmp_path / "absent")
    assert loaded.settings.engine == "vllm"
    assert len(loaded.warnings) == 1
    assert "absent" in loaded.warnings[0] and "not a directory" in loaded.warnings[0]


def test_no_podinfo_configured_no_warnings() -> None:
    loaded = load()
    assert loaded.settings.kv_connector == "shfs"
    assert loaded.warnings == ()
