"""What a start says about its settings, and ``disagg-sidecar config``.

    log_effective_settings(loaded, logger)  warnings; one short INFO line (engine, connector,
                                            role, ports, where settings came from); the whole
                                            report as JSON at debug level
    run_config_command(args)                the report (values, sources, warnings) as JSON

Quiet by default (issue #29): a start logs one line at INFO, and a warning only for what an
operator should fix (the load's warnings, an allowlist that admits no router-named target).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any, TextIO

from sidecar.config.checks import ConfigError, empty_allowlist_warning
from sidecar.config.loader import SOURCE_DEFAULT, LoadedSettings, field_names, load_settings
from sidecar.dialects import DIALECTS, uses_connectors


def settings_report(loaded: LoadedSettings) -> dict[str, Any]:
    """JSON-able: each field's value and source, and the warnings."""
    dumped = loaded.settings.model_dump(mode="json")
    return {
        "settings": {
            name: {"value": dumped[name], "source": loaded.sources.get(name, SOURCE_DEFAULT)}
            for name in field_names()
        },
        "warnings": list(loaded.warnings),
    }


def start_up_warnings(loaded: LoadedSettings) -> list[str]:
    """What serving with these settings should warn about: the load's warnings, and an
    allowlist that admits no router-named prefill target (``config`` reports the former)."""
    warnings = list(loaded.warnings)
    empty = empty_allowlist_warning(loaded.settings, _Sources(loaded.sources))
    if empty is not None:
        warnings.append(empty)
    return warnings


class _Sources:
    def __init__(self, sources: Mapping[str, str]) -> None:
        self._sources = sources

    def source_of(self, name: str) -> str:
        return self._sources.get(name, SOURCE_DEFAULT)


def start_up_line(loaded: LoadedSettings) -> str:
    """The one INFO line of a start: engine, connector, role, ports, where settings came
    from (the full report is logged at debug level)."""
    s = loaded.settings
    connector = f", connector {s.kv_connector}" if uses_connectors(s.engine) else ""
    if s.engine not in DIALECTS.engines():  # let in by --allow-unregistered-engine
        connector = " (not registered: the default dialect, no hand-off)"
    ports = [f"http :{s.port}"]
    if s.grpc_enabled:
        ports.append(f"grpc :{s.grpc_port}")
    if s.metrics_port is not None:
        ports.append(f"metrics :{s.metrics_port}")
    kinds: dict[str, int] = {}
    for source in loaded.sources.values():
        if source != SOURCE_DEFAULT:
            kind = source.split(" ", 1)[0] if " " in source else source
            kinds[kind] = kinds.get(kind, 0) + 1
    given = ", ".join(f"{count} from {kind}" for kind, count in sorted(kinds.items()))
    return (
        f"engine {s.engine}{connector}, role {s.role.value}, engine at {s.engine_url}; "
        f"{', '.join(ports)}; settings: {given or 'all defaults'} (the rest defaults; "
        "--log-level debug shows each)"
    )


def log_effective_settings(loaded: LoadedSettings, logger: logging.Logger) -> None:
    """Log the warnings, one short INFO line, and the effective settings with sources as one
    JSON line at debug level."""
    for warning in start_up_warnings(loaded):
        logger.warning("config: %s", warning)
    logger.info("%s", start_up_line(loaded))
    if logger.isEnabledFor(logging.DEBUG):
        report = settings_report(loaded)["settings"]
        logger.debug("effective settings: %s", json.dumps(report, separators=(",", ":")))


def run_config_command(
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """``disagg-sidecar config``: print the report as JSON and return 0; 2 on a bad config."""
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    try:
        loaded = load_settings(args, os.environ if environ is None else environ)
    except ConfigError as exc:
        print(f"disagg-sidecar: invalid configuration: {exc}", file=err)
        return 2
    print(json.dumps(settings_report(loaded), indent=2), file=out)
    return 0
