"""Proves the generated configuration reference covers every setting, so it cannot drift.

Covered: every Settings field has a description (adding one without documentation fails
here), every field has an entry (a heading, then its flag, env variable and default) in the
section of its ``serve --help`` group, every label and annotation key appears, the precedence
line is present, descriptions show ``*`` and ``<`` as written, an undocumented field is
refused by the generator, and ``python -m sidecar.config.docs`` prints the same text. The docs
page's copy is checked in test_reference_in_docs; how the page reads at laptop width, on the
built site (tests/docs/test_docs_layout.py).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from sidecar.config import docs as config_docs
from sidecar.config.docs import UndocumentedSetting, configuration_reference_markdown
from sidecar.config.groups import grouped
from sidecar.config.loader import env_for, flag_for
from sidecar.config.settings import POD_SOURCES, Settings


@pytest.mark.parametrize("name", list(Settings.model_fields))
def test_every_setting_is_documented(name: str) -> None:
    description = Settings.model_fields[name].description
    assert description and description.strip(), f"Settings.{name} needs a description"


def entries(text: str) -> dict[str, str]:
    """Setting name -> its entry (heading to the next heading) in the reference."""
    found: dict[str, str] = {}
    for chunk in text.split("\n### ")[1:]:
        heading, _, body = chunk.partition("\n")
        found[heading.strip("`")] = body.split("\n## ")[0]
    return found


def test_every_setting_has_an_entry() -> None:
    text = configuration_reference_markdown()
    found = entries(text)
    assert list(found) == [name for _, names in grouped(list(Settings.model_fields))
                           for name in names]
    for name in Settings.model_fields:
        entry = found[name]
        assert f"flag `{flag_for(name)}`" in entry
        assert f"env `{env_for(name)}`" in entry
        assert "default " in entry
    for pod in POD_SOURCES.values():
        assert f"{pod.kind} `{Settings.model_fields[pod.key_field].default}`" in text
    assert "Precedence, highest first" in text
    assert "`POD_IP`" in found["advertise_host"]


def test_settings_are_sectioned_as_serve_help_groups_them() -> None:
    text = configuration_reference_markdown()
    sections = [line[3:] for line in text.splitlines() if line.startswith("## ")]
    assert sections[0] == "The local engine, its KV connector and this sidecar's role"
    assert len(sections) == len(grouped(list(Settings.model_fields)))
    assert text.index("### `engine`") < text.index("## Where the sidecar listens") < (
        text.index("### `port`"))


def test_descriptions_are_shown_as_written() -> None:
    found = entries(configuration_reference_markdown())
    assert r"HOST:\*, CIDR:PORT, CIDR:\*" in found["prefill_allowlist"]
    assert "&lt;id>_dp&lt;rank>" in found["nixl_push_engine_id"]


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
