"""Proves every refusal: a bad value stops start-up with a message naming value and source.

Covered: bad port label, bad bootstrap annotation, machine id out of range, unknown connector
by flag or env (valid names listed, sorted), a connector set for an engine it does not serve,
bad prefill URLs, bad allowlist entries, the sidecar on the engine's port (and two listeners
on one port), bad booleans, enums and numbers from flags and env, malformed podinfo files, and
that pydantic's errors never escape as such. Not covered: fallbacks (test_config_fallbacks).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from config_builders import FIXTURES, load, write_podinfo

from sidecar.config.loader import ConfigError


def refused(argv: list[str] | None = None, env: dict[str, str] | None = None,
            podinfo: Path | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load(argv or [], env, podinfo=podinfo)
    return str(info.value)


@pytest.mark.parametrize("port", ["http", "0", "65536", "-1", "80.0", "\uff18\uff10"])
def test_bad_port_label(tmp_path: Path, port: str) -> None:
    pod = write_podinfo(tmp_path, labels={"model.aibrix.ai/port": port})
    message = refused(podinfo=pod)
    assert "label model.aibrix.ai/port" in message and repr(port) in message


def test_bad_port_label_ignored_when_engine_url_given(tmp_path: Path) -> None:
    pod = write_podinfo(tmp_path, labels={"model.aibrix.ai/port": "http"})
    loaded = load(["--engine-url", "http://127.0.0.1:8200"], podinfo=pod)
    assert loaded.settings.engine_url == "http://127.0.0.1:8200"


@pytest.mark.parametrize("value", ["", "x", "0", "70000"])
def test_bad_bootstrap_annotation(tmp_path: Path, value: str) -> None:
    pod = write_podinfo(tmp_path, annotations={"model.aibrix.ai/sglang-bootstrap-port": value})
    message = refused(podinfo=pod)
    assert "annotation model.aibrix.ai/sglang-bootstrap-port" in message
    assert repr(value) in message


@pytest.mark.parametrize(
    ("argv", "env", "source"),
    [
        (["--trtllm-machine-id", "1024"], {}, "flag --trtllm-machine-id"),
        (["--trtllm-machine-id", "-1"], {}, "flag --trtllm-machine-id"),
        ([], {"DISAGG_TRTLLM_MACHINE_ID": "many"}, "env DISAGG_TRTLLM_MACHINE_ID"),
    ],
)
def test_bad_machine_id(argv: list[str], env: dict[str, str], source: str) -> None:
    message = refused(argv, env)
    assert "trtllm_machine_id" in message and source in message


@pytest.mark.parametrize(
    ("argv", "env", "source"),
    [
        (["--kv-connector", "lmcache"], {}, "flag --kv-connector"),
        ([], {"DISAGG_KV_CONNECTOR": "lmcache"}, "env DISAGG_KV_CONNECTOR"),
        (["--default-kv-connector", "lmcache"], {}, "flag --default-kv-connector"),
    ],
)
def test_unknown_connector_by_flag_or_env(argv: list[str], env: dict[str, str],
                                          source: str) -> None:
    message = refused(argv, env)
    assert "'lmcache'" in message and source in message
    assert "mooncake, nixl, nixl-push, shfs" in message


@pytest.mark.parametrize("engine_source", ["flag", "label"])
def test_connector_for_engine_it_does_not_serve(tmp_path: Path, engine_source: str) -> None:
    pod = write_podinfo(tmp_path, labels={"model.aibrix.ai/engine": "sglang"})
    argv = ["--kv-connector", "mooncake"]
    if engine_source == "flag":
        argv += ["--engine", "sglang"]
    message = refused(argv, podinfo=pod)
    assert "'mooncake'" in message and "flag --kv-connector" in message
    assert "'sglang'" in message


@pytest.mark.parametrize(
    "url",
    [
        "prefill:8000",
        "ftp://prefill:8000",
        "http://prefill",
        "http://prefill:0",
        "http://prefill:8000/",
        "http://prefill:8000/v1",
        "http://prefill:8000?x=1",
        "http://prefill:8000#f",
        "http://user@prefill:8000",
        "http://prefill:99999",
        "http://:8000",
    ],
)
def test_bad_prefill_url(url: str) -> None:
    message = refused(["--prefill-url", url])
    assert "prefill_urls" in message and "flag --prefill-url" in message and url in message


def test_bad_prefill_url_from_env() -> None:
    message = refused(env={"DISAGG_PREFILL_URLS": "http://ok:1,http://bad"})
    assert "env DISAGG_PREFILL_URLS" in message and "http://bad" in message


@pytest.mark.parametrize("entry", ["*:8000", "10.0.0.1/8:*", "prefill", "fd00::1:80"])
def test_bad_allowlist_entry(entry: str) -> None:
    message = refused(env={"DISAGG_PREFILL_ALLOWLIST": f"10.0.0.0/8:*,{entry}"})
    assert "prefill_allowlist" in message and "env DISAGG_PREFILL_ALLOWLIST" in message
    assert repr(entry) in message


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--port", "8000"], {}),
        (["--port", "8200"], {"DISAGG_ENGINE_URL": "http://localhost:8200"}),
        (["--port", "80"], {"DISAGG_ENGINE_URL": "http://127.0.0.1"}),
        (["--port", "8200"], {"DISAGG_ENGINE_URL": "http://[::1]:8200/"}),
    ],
)
def test_sidecar_on_engine_port(argv: list[str], env: dict[str, str]) -> None:
    message = refused(argv, env)
    assert "flag --port" in message and "engine_url" in message


def test_same_port_from_label(tmp_path: Path) -> None:
    pod = write_podinfo(tmp_path, labels={"model.aibrix.ai/port": "8080"})
    message = refused(podinfo=pod)
    assert "port 8080 (from default)" in message and "label model.aibrix.ai/port" in message


def test_same_port_on_remote_engine_is_fine() -> None:
    assert load(["--port", "8000", "--engine-url", "http://engine.svc:8000"]).settings.port == 8000


def test_port_zero_never_conflicts() -> None:
    loaded = load(["--port", "0", "--grpc-port", "0", "--metrics-port", "0",
                   "--engine-url", "http://127.0.0.1:0"])
    assert loaded.settings.port == 0


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--grpc-port", "8080"], ("grpc_port", "port")),
        (["--metrics-port", "50051"], ("metrics_port", "grpc_port")),
    ],
)
def test_two_listeners_on_one_port(argv: list[str], names: tuple[str, str]) -> None:
    message = refused(argv)
    assert all(name in message for name in names)


def test_grpc_port_free_when_grpc_disabled() -> None:
    assert load(["--no-grpc", "--grpc-port", "8080"]).settings.grpc_enabled is False


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        ([], {"DISAGG_TRUSTED_ROUTER": "maybe"}, "env DISAGG_TRUSTED_ROUTER"),
        (["--role", "leader"], {}, "flag --role"),
        ([], {"DISAGG_ON_PREFILL_FAILURE": "retry"}, "env DISAGG_ON_PREFILL_FAILURE"),
        (["--kv-transport", "rdma"], {}, "flag --kv-transport"),
        (["--port", "eighty"], {}, "flag --port"),
        (["--connect-timeout-s", "0"], {}, "flag --connect-timeout-s"),
        (["--log-level", "loud"], {}, "flag --log-level"),
        (["--log-format", "xml"], {}, "flag --log-format"),
        (["--engine-url", "tcp://engine:1"], {}, "flag --engine-url"),
        (["--engine-url", "http://engine:1?x"], {}, "flag --engine-url"),
        (["--engine-url", "http://engine:port"], {}, "flag --engine-url"),
        (["--engine", " "], {}, "flag --engine"),
        (["--engine-label", ""], {}, "flag --engine-label"),
    ],
)
def test_bad_values_name_their_source(argv: list[str], env: dict[str, str], needle: str) -> None:
    message = refused(argv, env)
    assert needle in message
    assert "validation error" not in message.lower()  # pydantic's own text never leaks
    assert "Traceback" not in message


def test_several_bad_values_all_named() -> None:
    message = refused(["--port", "x"], {"DISAGG_GRPC_PORT": "y"})
    assert "flag --port" in message and "env DISAGG_GRPC_PORT" in message


def test_malformed_podinfo_file() -> None:
    message = refused(podinfo=FIXTURES / "malformed")
    assert "labels line 2" in message


@pytest.mark.parametrize("path", ["/v1", "/v1/", "/api/v1"])
def test_an_engine_url_with_a_path_is_refused_saying_what_to_write(path: str) -> None:
    # The sidecar appends /v1/completions itself: a path would send every call to
    # /v1/v1/..., /ready would stay 503 and every PD request answer 502.
    message = refused(["--engine-url", f"http://127.0.0.1:8200{path}"])
    assert "flag --engine-url" in message and f"{path!r}" in message, message
    assert "http://127.0.0.1:8200" in message.split("write")[-1], message


def test_an_engine_url_with_only_a_trailing_slash_is_accepted() -> None:
    assert load(["--engine-url", "https://engine:8443/"]).settings.engine_url == (
        "https://engine:8443")


def test_a_prefill_url_with_a_path_says_what_to_write() -> None:
    message = refused(["--prefill-url", "http://10.0.0.7:8000/v1"])
    assert "flag --prefill-url" in message and "'/v1'" in message, message
    assert "http://10.0.0.7:8000" in message.split("write")[-1], message


@pytest.mark.parametrize("missing", ["opentelemetry.sdk",
                                     "opentelemetry.exporter.otlp.proto.grpc",
                                     "opentelemetry.exporter.otlp.proto.http"])
def test_an_otlp_endpoint_without_the_tracing_extra_is_refused(
    missing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # as if not installed
    endpoint = ("grpc://127.0.0.1:4317" if "http" not in missing.rsplit(".", 1)[-1]
                else "http://127.0.0.1:4318")
    message = refused(["--otlp-endpoint", endpoint])
    assert "flag --otlp-endpoint" in message and "disagg-sidecar[tracing]" in message, message


def test_tracing_off_needs_no_tracing_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk", None)
    assert load([]).settings.otlp_endpoint is None
