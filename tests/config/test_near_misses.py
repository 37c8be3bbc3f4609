"""Proves that settings which nearly say what was meant are not taken silently (issue #36).

Covered: a ``DISAGG_*`` variable that is no setting's (``DISAGG_ENGNE``) is ignored with a
warning naming the closest setting's variable, one in the wrong case names its upper-case
spelling, one close to nothing points at the reference, and real settings' variables raise
none; ``config`` lists the warning. An allowlist entry that names a host warns that entries
match literally (``localhost:23102`` does not admit a router naming ``127.0.0.1:23102``),
entries naming addresses and networks do not warn. The refusal of an unregistered engine
name and the rule for case are proven in test_cli_words.

Not covered: the 403 a literal mismatch gets at request time (tests/targets).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from config_builders import load

from sidecar.config.unknown_env import unknown_variable_warnings

SIDECAR = [sys.executable, "-m", "sidecar"]


def test_a_misspelt_variable_warns_naming_the_closest() -> None:
    loaded = load(env={"DISAGG_ENGNE": "sglang"})
    assert loaded.settings.engine == "vllm"  # ignored, as the warning says
    (warning,) = loaded.warnings
    assert warning == ("environment variable DISAGG_ENGNE is not a setting and is ignored "
                       "(did you mean DISAGG_ENGINE?)")


def test_a_variable_in_lower_case_names_its_upper_case_spelling() -> None:
    (warning,) = load(env={"disagg_engine": "sglang"}).warnings
    assert "disagg_engine is not a setting" in warning
    assert "names are upper case: DISAGG_ENGINE" in warning


def test_a_variable_close_to_nothing_points_at_the_reference() -> None:
    (warning,) = unknown_variable_warnings({"DISAGG_ZZZ_QQQ": "1"}, "DISAGG_",
                                           ["DISAGG_ENGINE", "DISAGG_ROLE"])
    assert "DISAGG_ZZZ_QQQ is not a setting" in warning
    assert "docs/operating/configuration.md" in warning


def test_settings_variables_and_other_variables_raise_nothing() -> None:
    env = {"DISAGG_ENGINE": "sglang", "DISAGG_ROLE": "decode", "PATH": "/usr/bin",
           "POD_IP": "10.0.0.7", "OTHER_DISAGG_ENGNE": "x"}
    loaded = load(env=env)
    assert loaded.settings.engine == "sglang"
    assert loaded.warnings == ()


def test_config_reports_the_misspelt_variable() -> None:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("DISAGG_")}
    result = subprocess.run([*SIDECAR, "config"], env={**env, "DISAGG_PREFIL_URLS": "x"},
                            capture_output=True, text=True, timeout=60, check=True)
    warnings = json.loads(result.stdout)["warnings"]
    assert any("DISAGG_PREFIL_URLS" in w and "did you mean DISAGG_PREFILL_URLS?" in w
               for w in warnings), warnings


def test_a_host_name_allowlist_entry_says_entries_match_literally() -> None:
    loaded = load(["--prefill-allowlist", "localhost:23102"])
    (warning,) = loaded.warnings
    assert "'localhost:23102' (from flag --prefill-allowlist) names a host" in warning
    assert "entries match literally" in warning
    assert "admits a router naming localhost:23102 and refuses one naming 127.0.0.1:23102" \
        in warning


def test_a_named_host_with_any_port_warns_too() -> None:
    (warning,) = load(env={"DISAGG_PREFILL_ALLOWLIST": "prefill.ns.svc:*"}).warnings
    assert "(from env DISAGG_PREFILL_ALLOWLIST)" in warning
    assert "refuses one naming one of its addresses:PORT" in warning


@pytest.mark.parametrize("entry", ["127.0.0.1:23102", "10.0.0.0/8:*", "[fd00::/8]:8000",
                                   "[::1]:8100"])
def test_address_and_network_entries_do_not_warn(entry: str) -> None:
    assert load(["--prefill-allowlist", entry]).warnings == ()
