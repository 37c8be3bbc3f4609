"""Proves the generated configuration reference covers every setting, so it cannot drift.

Covered: every Settings field has a description (adding one without documentation fails
here), every field has a row naming its flag, env variable and default, every label and
annotation key appears, the precedence line is present, an undocumented field is refused by
the generator, and ``python -m sidecar.config.docs`` prints the same text. The docs page's copy
is checked in test_reference_in_docs.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from sidecar.config import docs as config_docs
from sidecar.config.docs import UndocumentedSetting, configuration_reference_markdown
from sidecar.config.loader import env_for, flag_for
from sidecar.config.settings import POD_SOURCES, Settings


@pytest.mark.parametrize("name", list(Settings.model_fields))
def test_every_setting_is_documented(name: str) -> None:
    description = Settings.model_fields[name].description
    assert description and description.strip(), f"Settings.{name} needs a description"


def test_every_setting_has_a_row() -> None:
    text = configuration_reference_markdown()
    rows = {line.split("|")[1].strip(): line for line in text.splitlines()
            if line.startswith("| `")}
    assert set(rows) == {f"`{name}`" for name in Settings.model_fields}
    for name in Settings.model_fields:
        row = rows[f"`{name}`"]
        assert f"`{flag_for(name)}`" in row
        assert f"`{env_for(name)}`" in row
    for pod in POD_SOURCES.values():
        assert f"{pod.kind} `{Settings.model_fields[pod.key_field].default}`" in text
    assert "Precedence, highest first" in text
    assert "`POD_IP`" in rows["`advertise_host`"]


def test_undocumented_field_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    info = Settings.model_fields["engine"]
    monkeypatch.setattr(info, "description", None)
    with pytest.raises(UndocumentedSetting, match="engine"):
        configuration_reference_markdown()


def test_module_prints_the_reference() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sidecar.config.docs"], capture_output=True, text=True, check=True
    )
    assert result.stdout == config_docs.configuration_reference_markdown()
