"""Proves the command line explains itself: every flag of every subcommand has a help text,
``stub-engine --fault`` lists the fault kinds, defaults print as values (never ``None`` or
nothing), ``--on-prefill-failure`` names its values, settings are named by their flags in
every help text (a setting's name, e.g. ``tls_key_file``, appears only next to its flag in
the generated reference (docs/operating/configuration.md)), and the allowlist's refusal lists every
accepted form.
"""

from __future__ import annotations

import argparse
import re

import pytest

from sidecar.__main__ import build_parser
from sidecar.config.loader import field_names
from sidecar.targets.allowlist import parse_entry
from sidecar.tools.stubs.faults import FaultKind


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("command", ["serve", "config", "demo", "stub-engine", "route"])
def test_every_flag_has_a_help_text(command: str) -> None:
    flags = _flags(_subparsers()[command])
    missing = [a.option_strings[0] for a in flags if not a.help or a.help == argparse.SUPPRESS]
    assert flags and not missing, missing


def test_the_fault_flag_lists_every_fault_kind() -> None:
    fault = next(a for a in _flags(_subparsers()["stub-engine"]) if "--fault" in a.option_strings)
    assert fault.help is not None
    assert all(kind.value in fault.help for kind in FaultKind), fault.help


@pytest.mark.parametrize("command", ["serve", "stub-engine", "route"])
def test_defaults_print_as_values(command: str) -> None:
    text = _subparsers()[command].format_help()
    flat = " ".join(text.split())
    assert "None" not in flat, [line for line in text.splitlines() if "None" in line]
    assert not re.search(r"default: ?[\];]", flat), re.findall(r".{40}default: ?[\];]", flat)


def test_on_prefill_failure_names_its_values() -> None:
    action = next(a for a in _flags(_subparsers()["serve"])
                  if "--on-prefill-failure" in a.option_strings)
    assert action.help is not None and "fail" in action.help and "local" in action.help
    assert action.metavar == "{fail,local}" or "fail, local" in action.help


def test_settings_are_named_by_their_flags_in_help_texts() -> None:
    names = [name for name in field_names() if "_" in name]
    pattern = re.compile(r"(?<![-\w])(" + "|".join(map(re.escape, names)) + r")(?![-\w])")
    found = {a.option_strings[0]: pattern.findall(a.help or "")
             for a in _flags(_subparsers()["serve"])}
    assert not {flag: hits for flag, hits in found.items() if hits}


def test_the_allowlist_refusal_lists_every_accepted_form() -> None:
    with pytest.raises(ValueError) as refused:
        parse_entry("10.0.0.7")
    for form in ("HOST:PORT", "HOST:*", "CIDR:PORT", "CIDR:*"):
        assert form in str(refused.value), refused.value
