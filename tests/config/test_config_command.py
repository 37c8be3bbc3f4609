"""Proves ``disagg-sidecar config`` output and the start-up log of the effective settings.

Covered: the JSON report (every field, value and source, warnings) printed by
``run_config_command`` in-process, exit code 2 with the message on stderr for a bad config, the
one-line log, and the argparse surface (one flag per field, defaults None, help text).
Not covered: the CLI entry point itself (``sidecar.__main__``, owned by the lead).
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest
from config_builders import FIXTURES, args, load, parser

from sidecar.config.loader import flag_for
from sidecar.config.report import log_effective_settings, run_config_command, settings_report
from sidecar.config.settings import Settings


def run(argv: list[str], env: dict[str, str] | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run_config_command(args(*argv), env or {}, stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_config_prints_values_and_sources() -> None:
    code, out, err = run(
        ["--podinfo-dir", str(FIXTURES / "aibrix-decode"), "--prefill-url", "http://p:1"],
        {"DISAGG_PORT": "9000", "POD_IP": "10.0.0.9"},
    )
    assert code == 0 and err == ""
    report = json.loads(out)
    settings = report["settings"]
    assert list(settings) == list(Settings.model_fields)
    assert settings["engine_url"] == {
        "value": "http://127.0.0.1:8200", "source": "label model.aibrix.ai/port",
    }
    assert settings["kv_connector"] == {
        "value": "nixl", "source": "label model.aibrix.ai/kv-connector-type",
    }
    assert settings["role"] == {"value": "decode", "source": "label role-name"}
    assert settings["port"] == {"value": 9000, "source": "env DISAGG_PORT"}
    assert settings["advertise_host"] == {"value": "10.0.0.9", "source": "env POD_IP"}
    assert settings["prefill_urls"] == {"value": ["http://p:1"], "source": "flag --prefill-url"}
    assert settings["grpc_enabled"] == {"value": True, "source": "default"}
    assert settings["metrics_port"] == {"value": None, "source": "default"}
    assert report["warnings"] == []


def test_config_reports_warnings(tmp_path: Path) -> None:
    code, out, _ = run(["--podinfo-dir", str(tmp_path)])
    assert code == 0
    assert len(json.loads(out)["warnings"]) == 1


def test_config_refuses_bad_value() -> None:
    code, out, err = run(["--trtllm-machine-id", "5000"])
    assert code == 2 and out == ""
    assert "trtllm_machine_id" in err and "'5000'" in err and "flag --trtllm-machine-id" in err
    assert "Traceback" not in err


def test_config_reads_process_environment(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("DISAGG_ENGINE", "trtllm")
    assert run_config_command(args()) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["settings"]["engine"] == {"value": "trtllm", "source": "env DISAGG_ENGINE"}


def test_report_is_json_for_every_field() -> None:
    report = settings_report(load())
    assert json.loads(json.dumps(report)) == report


def test_log_effective_settings_once(caplog: pytest.LogCaptureFixture) -> None:
    # INFO: one short line (engine, connector, role, ports, sources); the full report as JSON
    # only at debug level (issue #29: a quiet start); every warning at WARNING.
    loaded = load(["--podinfo-dir", str(FIXTURES / "absent"), "--prefill-allowlist",
                   "10.0.0.1:1"])
    logger = logging.getLogger("test.config")
    with caplog.at_level(logging.INFO, logger="test.config"):
        log_effective_settings(loaded, logger)
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(infos) == 1 and len(warnings) == 1
    line = infos[0].getMessage()
    assert len(line) < 300 and "{" not in line, line
    assert "engine vllm, connector shfs, role both" in line and "http :8080" in line
    assert "2 from flag" in line, line
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="test.config"):
        log_effective_settings(loaded, logger)
    (debug,) = [r for r in caplog.records if r.levelno == logging.DEBUG]
    logged = json.loads(debug.getMessage().split(": ", 1)[1])
    assert logged == settings_report(loaded)["settings"]


def test_an_empty_allowlist_warns_at_start_up(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test.config")
    for argv, warned in ((["--role", "decode"], True), ([], True),
                         (["--role", "prefill"], False),
                         (["--prefill-allowlist", "10.0.0.0/8:8000"], False),
                         (["--prefill-url", "http://10.0.0.7:8000"], False),
                         (["--prefill-pod-selector", "role-name=prefill"], False)):
        caplog.clear()
        loaded = load(argv)
        with caplog.at_level(logging.INFO, logger="test.config"):
            log_effective_settings(loaded, logger)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert loaded.warnings == ()  # a start-up warning; `config` reports the load's own
        assert bool(warnings) is warned, (argv, warnings)
        if warned:
            assert "allowlist is empty" in warnings[0] and "403" in warnings[0]
            assert "--prefill-allowlist" in warnings[0]


def test_one_flag_per_field_all_defaults_none() -> None:
    namespace = args()
    for name in Settings.model_fields:
        assert getattr(namespace, name) is None, name
    help_text = parser().format_help()
    for name in Settings.model_fields:
        assert flag_for(name) in help_text
    assert "--no-grpc" in help_text and "DISAGG_TRTLLM_MACHINE_ID" in help_text


def test_expected_flag_names() -> None:
    expected = {
        "engine": "--engine", "kv_connector": "--kv-connector", "grpc_enabled": "--grpc",
        "prefill_urls": "--prefill-url", "prefill_allowlist": "--prefill-allowlist",
        "trtllm_machine_id": "--trtllm-machine-id", "log_format": "--log-format",
    }
    for name, flag in expected.items():
        assert flag_for(name) == flag
