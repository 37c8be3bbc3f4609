"""Proves the command line says what it means (issue #29):

- ``serve --help`` shows its flags in argument groups by topic (engine, prefill targets,
  limits, TLS, observability, workers, gRPC, ...) and ends with an example; every setting
  sits in a named group;
- an unknown flag is answered with the subcommand's usage and the closest flag it has;
- vLLM's connector class names are aliases of AIBrix's label values, case-insensitive, in
  flags, the environment and pod labels, resolved from the aliases each dialect declares;
- an engine name no dialect is registered for (``vlm``) is refused, from a flag, a variable
  or a label, naming the closest registered engine and the flag that asks for the default
  dialect (issue #36); with that flag it runs on the default dialect without a warning;
  ``serve`` and ``config`` exit 2 with the message; an unknown role label value warns with
  the valid values;
- one rule for case: ``--role``, ``--engine``, ``--kv-connector`` and every other word a
  setting chooses among read case-insensitively, in flags and variables; ``demo`` and
  ``stub-engine`` take their engine, role and connector words the same way;
- ``demo`` refuses a connector its engine does not use.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
from pathlib import Path

import pytest
from config_builders import load, write_podinfo

from sidecar.__main__ import build_parser, main, unrecognized_message
from sidecar.config.checks import ConfigError
from sidecar.config.groups import FLAG_GROUPS, OTHER, group_of
from sidecar.config.loader import field_names, flag_for, is_choice_field
from sidecar.config.report import start_up_line
from sidecar.config.settings import Settings
from sidecar.dialects import DIALECTS, dialect_class
from sidecar.dialects.base import Dialect
from sidecar.dialects.default import DefaultDialect
from sidecar.dialects.registry import DialectLoadError, DialectRegistry
from sidecar.tools.demo import DemoUsageError, demo_connector

SIDECAR = [sys.executable, "-m", "sidecar"]


def _serve() -> argparse.ArgumentParser:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve: argparse.ArgumentParser = action.choices["serve"]
    return serve


def test_serve_help_is_grouped_with_an_example() -> None:
    text = _serve().format_help()
    titles = [group.title for group in _serve()._action_groups]
    for wanted in ("engine", "prefill targets", "limits and timeouts", "TLS", "observability",
                   "workers", "gRPC front door", "engine-specific"):
        assert wanted in titles, titles
    assert text.index("\nengine:") < text.index("\nprefill targets:") < text.index("\nTLS:")
    assert "\nexample:" in text and text.rstrip().endswith("docs/operating/configuration.md")
    assert "disagg-sidecar serve --engine vllm" in text.split("\nexample:")[1]


def test_every_setting_is_in_a_named_group() -> None:
    assert not [name for name in field_names() if group_of(name) is OTHER]
    named = [name for group in FLAG_GROUPS for name in group.fields]
    assert len(named) == len(set(named)), "a field is named by two groups"


def test_a_mistyped_flag_gets_the_subcommands_usage_and_the_closest_flag() -> None:
    result = subprocess.run([*SIDECAR, "serve", "--engin-url", "http://127.0.0.1:8000"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert result.stderr.startswith("usage: disagg-sidecar serve"), result.stderr
    assert "unrecognized arguments: --engin-url http://127.0.0.1:8000" in result.stderr
    assert "did you mean --engine-url" in result.stderr


def test_the_suggestion_reads_flag_equals_value_and_skips_far_names() -> None:
    serve = _serve()
    assert "did you mean --prefill-allowlist" in unrecognized_message(
        serve, ["--prefill-alowlist=10.0.0.1:8000"])
    assert "did you mean" not in unrecognized_message(serve, ["--zzzzqqq"])


def test_main_answers_an_unknown_flag_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["config", "--kv-conector", "shfs"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "usage: disagg-sidecar config" in err and "did you mean --kv-connector" in err


@pytest.mark.parametrize(("given", "resolved"), [
    ("NixlConnector", "shfs"), ("nixlconnector", "shfs"), ("NIXLCONNECTOR", "shfs"),
    ("MooncakeConnector", "mooncake"), ("mooncakeconnector", "mooncake"),
    ("NixlPushConnector", "nixl-push"), ("nixlpushconnector", "nixl-push"),
    ("shfs", "shfs"), ("Mooncake", "mooncake"), ("nixl", "nixl"),
])
def test_connector_aliases_in_flags_env_and_labels(tmp_path: Path, given: str,
                                                   resolved: str) -> None:
    assert load(["--kv-connector", given]).settings.kv_connector == resolved
    assert load(env={"DISAGG_KV_CONNECTOR": given}).settings.kv_connector == resolved
    assert load(["--default-kv-connector", given]).settings.default_kv_connector == resolved
    pod = write_podinfo(tmp_path, {"model.aibrix.ai/engine": "vllm",
                                   "model.aibrix.ai/kv-connector-type": given}, {})
    loaded = load(podinfo=pod)
    assert loaded.settings.kv_connector == resolved
    assert loaded.sources["kv_connector"] == "label model.aibrix.ai/kv-connector-type"
    assert loaded.warnings == ()


def test_aliases_come_from_the_dialects() -> None:
    aliases = DIALECTS.connector_aliases()
    assert aliases == {"NixlConnector": "shfs", "MooncakeConnector": "mooncake",
                       "NixlPushConnector": "nixl-push"}
    for alias, connector in aliases.items():
        (engine,) = DIALECTS.engines_of(connector)
        assert alias in DIALECTS.get(engine, connector).aliases


def test_an_unknown_connector_names_the_aliases_too() -> None:
    with pytest.raises(ConfigError) as refused:
        load(["--kv-connector", "LMCacheConnector"])
    assert "NixlConnector" in str(refused.value) and "shfs" in str(refused.value)


class _Pull(Dialect):
    engine = "acme"
    connector = "pull"
    aliases = ("PullConnector",)

    def prefill_fields(self, ctx):  # type: ignore[no-untyped-def]
        return {}

    def handoff(self, prefill_response, ctx):  # type: ignore[no-untyped-def]
        return {}


class _Clash(_Pull):
    connector = "push"
    aliases = ("pullconnector",)


def test_a_new_dialect_declares_its_aliases_the_same_way(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = DialectRegistry()
    monkeypatch.setattr(registry, "_plugins_read", True)
    registry.register("acme.pull", f"{__name__}:_Pull")
    assert registry.connector_name("pullconnector") == "pull"
    assert registry.connector_name("Pull") == "pull"
    assert registry.connector_name("other") == "other"
    registry.register("acme.push", f"{__name__}:_Clash")
    with pytest.raises(DialectLoadError, match="already names connector"):
        registry.connector_aliases()


def test_a_misspelt_engine_is_refused_naming_the_closest(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        load(["--engine", "vlm"])
    message = str(refused.value)
    assert "engine 'vlm' (from flag --engine) is not registered" in message
    assert "did you mean 'vllm'?" in message and "--allow-unregistered-engine" in message
    with pytest.raises(ConfigError, match="from env DISAGG_ENGINE"):
        load(env={"DISAGG_ENGINE": "sglng"})
    pod = write_podinfo(tmp_path, {"model.aibrix.ai/engine": "sglng"}, {})
    with pytest.raises(ConfigError) as refused:
        load(podinfo=pod)
    assert "did you mean 'sglang'?" in str(refused.value)
    assert "label model.aibrix.ai/engine" in str(refused.value)


@pytest.mark.parametrize("how", ["flag", "env"])
def test_the_default_dialect_serves_an_unregistered_engine_when_asked(how: str) -> None:
    if how == "flag":
        loaded = load(["--engine", "lmdeploy", "--allow-unregistered-engine"])
    else:
        loaded = load(env={"DISAGG_ENGINE": "lmdeploy",
                           "DISAGG_ALLOW_UNREGISTERED_ENGINE": "true"})
    assert loaded.settings.engine == "lmdeploy"
    assert dialect_class(loaded.settings.engine, None) is DefaultDialect
    assert loaded.warnings == ()
    assert "engine lmdeploy (not registered: the default dialect, no hand-off)" in (
        start_up_line(loaded))


@pytest.mark.parametrize("command", ["serve", "config"])
def test_serve_and_config_refuse_a_misspelt_engine_with_exit_2(command: str) -> None:
    result = subprocess.run([*SIDECAR, command, "--engine", "trtlm"], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert result.stderr.startswith("disagg-sidecar: invalid configuration: engine 'trtlm'")
    assert "did you mean 'trtllm'?" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(("flag", "given", "resolved"), [
    ("--role", "Decode", "decode"), ("--role", "PREFILL", "prefill"),
    ("--engine", "VLLM", "vllm"), ("--engine", "SGLang", "sglang"),
    ("--kv-connector", "nixlconnector", "shfs"), ("--kv-connector", "Mooncake", "mooncake"),
    ("--kv-transport", "Inline", "inline"), ("--on-prefill-failure", "LOCAL", "local"),
    ("--log-level", "DEBUG", "debug"),
])
def test_one_rule_for_case_in_flags_and_env(flag: str, given: str, resolved: str) -> None:
    name = flag[2:].replace("-", "_")
    assert str(getattr(load([flag, given]).settings, name)) == resolved
    variable = "DISAGG_" + name.upper()
    assert str(getattr(load(env={variable: given}).settings, name)) == resolved


def test_every_word_a_setting_chooses_among_is_read_case_insensitively() -> None:
    choices = [name for name in field_names() if is_choice_field(name)]
    assert {"role", "kv_transport", "on_prefill_failure", "prompt_length_source"} <= set(choices)
    for name in choices:
        first = next(iter(Settings.model_fields[name].annotation))  # type: ignore[arg-type]
        flag = flag_for(name)
        assert getattr(load([flag, first.value.upper()]).settings, name) == first, name


@pytest.mark.parametrize("argv", [
    ["stub-engine", "--engine", "VLLM", "--role", "Decode", "--kv-connector", "SHFS"],
    ["demo", "--engine", "SGLang"],
])
def test_the_tools_take_names_in_any_case(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert args.engine in ("vllm", "sglang")
    assert getattr(args, "role", "decode") == "decode"
    assert getattr(args, "kv_connector", "shfs") in ("shfs", None)


@pytest.mark.parametrize(("label", "warned"), [
    ("decoder", True), ("prefil", True), ("worker", True),
    ("decode", False), ("Prefill", False), ("both", False),
])
def test_an_unknown_role_label_warns_with_the_valid_values(tmp_path: Path, label: str,
                                                           warned: bool) -> None:
    loaded = load(["--engine", "sglang"],
                  podinfo=write_podinfo(tmp_path, {"role-name": label}, {}))
    if not warned:
        assert loaded.warnings == ()
        return
    assert loaded.settings.role == "both"
    (warning,) = loaded.warnings
    assert f"role-name={label!r}" in warning and "valid values: both, decode, prefill" in warning
    if label == "decoder":
        assert "did you mean 'decode'?" in warning


@pytest.mark.parametrize(("engine", "given"), [("sglang", "mooncake"), ("trtllm", "shfs"),
                                               ("vllm", "sglang")])
def test_demo_refuses_a_connector_its_engine_does_not_use(engine: str, given: str) -> None:
    with pytest.raises(DemoUsageError, match=f"--kv-connector {given}"):
        demo_connector(engine, given)


def test_demo_takes_aliases_and_defaults() -> None:
    assert demo_connector("vllm", "MooncakeConnector") == "mooncake"
    assert demo_connector("vllm", None) == "shfs"
    assert demo_connector("sglang", None) == "shfs"  # unused by SGLang's stubs


def test_demo_command_refuses_with_exit_2() -> None:
    result = subprocess.run([*SIDECAR, "demo", "--engine", "sglang", "--kv-connector", "mooncake"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert "engine sglang uses none" in result.stderr
    assert result.stdout == ""


def test_demo_help_names_the_aliases() -> None:
    out = io.StringIO()
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out.write(action.choices["demo"].format_help())
    assert "NixlConnector = shfs" in " ".join(out.getvalue().split())


def test_the_docs_table_maps_every_label_value_to_vllms_names() -> None:
    page = Path(__file__).resolve().parents[2] / "docs" / "operating" / "deployment.md"
    section = page.read_text(encoding="utf-8").split('<a id="connector-names"></a>')[1]
    rows = {line.split("|")[1].strip(): line for line in section.splitlines()
            if line.startswith("| `")}
    assert set(rows) == {f"`{name}`" for name in DIALECTS.connectors("vllm")}
    for alias, connector in DIALECTS.connector_aliases().items():
        assert f"`{alias}`" in rows[f"`{connector}`"], (alias, connector)
