"""Builds the one ``Settings`` object from flags, environment and pod labels, and names sources.

    flags (--engine) > env (DISAGG_ENGINE, then extras such as POD_IP) > pod label/annotation
    (--podinfo-dir) > default                      ->  LoadedSettings(settings, sources, warnings)

Every field gets one flag (``--`` + the field name with dashes; ``--grpc/--no-grpc`` is the
exception, and list flags are singular and repeatable: ``--prefill-url``) and one variable
``DISAGG_<FIELD>``. Lists are comma-separated; booleans read true/false/1/0/yes/no; an empty
variable counts as unset. One rule for case: every name a setting chooses among (an engine, a
connector, a role, a transport, a policy, a log level) is read case-insensitively, from a
flag, a variable or a label alike (``--role Decode`` is ``decode``).
A ``DISAGG_*`` variable that is no setting's (a misspelling: ``DISAGG_ENGNE``) is ignored
with a warning naming the closest setting's variable.
The label rules are those of docs/driving/handoffs.md#pod-labels: a missing engine label means
the default engine; a missing or unknown connector label falls back to
``default_kv_connector`` with one warning (only for an engine that has connectors); the port
label gives ``http://127.0.0.1:<port>``; a role other than prefill or decode means both; a
dialect's own pod sources (``DialectOptions.pod_sources``) and the data-parallel size labels
are read as they declare; an unset prefill data-parallel size follows the local one (its
source says so). An engine name no dialect is registered for is refused by
``check_engine_registered`` unless ``allow_unregistered_engine`` says the default dialect is
meant.

A bad value raises ``ConfigError`` naming the field, the value and where it came from, so an
operator can fix the right layer; ``run_config_command`` prints the resolved settings with
their sources as JSON (``disagg-sidecar config``).

Deliberate limits: the loader only reads (it never logs; ``sidecar.config.report`` does,
once, when the caller is ready), and reads the pod's metadata once, at start.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any

from pydantic import ValidationError

from sidecar.config.checks import (
    ConfigError,
    allowlist_name_warnings,
    check_connector_engine,
    check_engine_registered,
    check_kv_events,
    check_ports,
    check_prompt_length_source,
    check_tls,
    check_tracing,
    closest_hint,
    data_parallel_warning,
)
from sidecar.config.groups import grouped
from sidecar.config.podinfo import PodInfo, PodInfoError, read_podinfo
from sidecar.config.settings import (
    CORE_POD_SOURCES,
    EXTRA_ENV,
    POD_SOURCES,
    Settings,
)
from sidecar.config.unknown_env import unknown_variable_warnings
from sidecar.dialects import DIALECTS, uses_connectors

ENV_PREFIX = "DISAGG_"
SOURCE_DEFAULT = "default"
#: Flags that are not simply ``--`` + the field name with dashes.
FLAG_OVERRIDES: Mapping[str, str] = MappingProxyType(
    {"grpc_enabled": "--grpc", "prefill_urls": "--prefill-url",
     "migration_urls": "--migration-url"}
)
#: Fields given as a list: repeatable or comma-separated flags, comma-separated env.
LIST_FIELDS = frozenset({"prefill_urls", "prefill_allowlist", "migration_urls"})
#: Fields whose flag may be repeated (each occurrence may also hold commas).
REPEATABLE_FIELDS = frozenset({"prefill_urls", "prefill_allowlist", "migration_urls"})

_TRUE = frozenset({"true", "1", "yes"})
_FALSE = frozenset({"false", "0", "no"})
_LABEL_ROLES = frozenset({"prefill", "decode"})


@dataclass(frozen=True)
class LoadedSettings:
    """The settings, where each field's value came from, and warnings raised while loading."""

    settings: Settings
    sources: Mapping[str, str]
    warnings: tuple[str, ...] = ()


def field_names() -> list[str]:
    """Settings fields in definition order."""
    return list(Settings.model_fields)


def flag_for(name: str) -> str:
    """The command-line flag that sets field ``name``."""
    return FLAG_OVERRIDES.get(name, "--" + name.replace("_", "-"))


def env_for(name: str) -> str:
    """The environment variable that sets field ``name``."""
    return ENV_PREFIX + name.upper()


def is_bool_field(name: str) -> bool:
    return Settings.model_fields[name].annotation is bool


def is_choice_field(name: str) -> bool:
    """True for a field that takes one of a fixed set of words (an ``Enum``): read
    case-insensitively, as engine and connector names are."""
    annotation = Settings.model_fields[name].annotation
    return isinstance(annotation, type) and issubclass(annotation, Enum)


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per Settings field, in argument groups by topic (``sidecar.config.groups``);
    every default is None so unset flags defer to env."""
    for topic, names in grouped(field_names()):
        group = parser.add_argument_group(topic.title, topic.description)
        for name in names:
            _add_setting(group, name)


def _add_setting(group: argparse._ArgumentGroup, name: str) -> None:
    """One field's flag, with its description, variable and default as its help."""
    info = Settings.model_fields[name]
    flag = flag_for(name)
    default = info.get_default(call_default_factory=True)
    text = f"{info.description or ''} [env {env_for(name)}; default: {shown_default(default)}]"
    help_text = text.replace("%", "%%")
    annotation = info.annotation
    choices = ([member.value for member in annotation]
               if isinstance(annotation, type) and issubclass(annotation, Enum) else None)
    metavar = "{" + ",".join(choices) + "}" if choices else name.upper()
    if is_bool_field(name):
        group.add_argument(
            flag,
            dest=name,
            action=argparse.BooleanOptionalAction,
            default=None,
            help=help_text,
        )
    elif name in REPEATABLE_FIELDS:
        group.add_argument(
            flag, dest=name, action="append", default=None, metavar=name.upper(),
            help=help_text,
        )
    else:
        group.add_argument(flag, dest=name, default=None, metavar=metavar, help=help_text)


def shown_default(value: Any) -> str:
    """A default as a value a reader can use: never ``None`` or nothing."""
    if value is None:
        return "unset"
    if isinstance(value, tuple):
        return ",".join(value) if value else "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Enum):
        return str(value.value)
    return str(value)


def _parse_bool(text: str, name: str, source: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ConfigError(
        f"invalid {name} {text!r} (from {source}): expected true/false/1/0/yes/no"
    )


def _split_list(values: list[str]) -> tuple[str, ...]:
    return tuple(item.strip() for value in values for item in value.split(",") if item.strip())


def _from_text(name: str, text: str, source: str) -> Any:
    """A flag or env string as the value handed to Settings (which checks it further)."""
    if is_bool_field(name):
        return _parse_bool(text, name, source)
    if name in LIST_FIELDS:
        return _split_list([text])
    if Settings.model_fields[name].default is None and not text.strip():
        return None
    if is_choice_field(name):
        return text.strip().lower()
    return text


def _explicit(
    args: argparse.Namespace, environ: Mapping[str, str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """Values set by flag or environment, and their sources."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name in field_names():
        flag_value = getattr(args, name, None)
        if flag_value is not None:
            source = f"flag {flag_for(name)}"
            if isinstance(flag_value, bool):
                values[name] = flag_value
            elif isinstance(flag_value, list):
                values[name] = _split_list([str(v) for v in flag_value])
            else:
                values[name] = _from_text(name, str(flag_value), source)
            sources[name] = source
            continue
        for env_name in (env_for(name), *EXTRA_ENV.get(name, ())):
            env_value = environ.get(env_name)
            # An empty variable is unset: templated manifests often render unused ones empty.
            if env_value is not None and env_value.strip():
                source = f"env {env_name}"
                values[name] = _from_text(name, env_value, source)
                sources[name] = source
                break
    return values, sources


def _default(name: str) -> Any:
    return Settings.model_fields[name].get_default(call_default_factory=True)


def _port_number(text: str, where: str) -> int:
    value = text.strip()
    if not (value.isascii() and value.isdigit() and 1 <= int(value) <= 65535):
        raise ConfigError(f"{where} has {text!r}, not a port number (1..65535)")
    return int(value)


class _Resolver:
    """One load: the values gathered so far, their sources, and the warnings."""

    def __init__(self, values: dict[str, Any], sources: dict[str, str]) -> None:
        self.values = values
        self.sources = sources
        self.warnings: list[str] = []
        self.pod_read = True

    def get(self, name: str) -> Any:
        return self.values[name] if name in self.values else _default(name)

    def set(self, name: str, value: Any, source: str) -> None:
        self.values[name] = value
        self.sources[name] = source

    def pod_value(self, pod: PodInfo, name: str) -> tuple[str | None, str]:
        """The pod's label/annotation value for field ``name`` and its source text."""
        kind, key_field, _ = POD_SOURCES[name]
        key = str(self.get(key_field))
        mapping = pod.labels if kind == "label" else pod.annotations
        return mapping.get(key), f"{kind} {key}"

    def apply_pod(self, pod: PodInfo | None) -> None:
        """Fill what flags and env left open from the pod (None: no pod info configured)."""
        if pod is None:
            pod = PodInfo()
            self.pod_read = False
        if "engine" not in self.values:
            label, source = self.pod_value(pod, "engine")
            if label is not None and label.strip():
                self.set("engine", label.strip().lower(), source)
        engine = str(self.get("engine")).strip().lower()

        if "kv_connector" not in self.values:
            self._connector_from_label(pod, engine)

        if "engine_url" not in self.values:
            label, source = self.pod_value(pod, "engine_url")
            if label is not None:
                port = _port_number(label, source)
                self.set("engine_url", f"http://127.0.0.1:{port}", source)

        if "role" not in self.values:
            label, source = self.pod_value(pod, "role")
            if label is not None:
                role = label.strip().lower()
                self.set("role", role if role in _LABEL_ROLES else "both", source)
                valid = sorted({*_LABEL_ROLES, "both"})
                if role and role not in valid:
                    self.warnings.append(
                        f"{source}={label!r} is neither prefill nor decode, so this sidecar "
                        f"serves both roles; valid values: {', '.join(valid)}"
                        f"{closest_hint(role, valid)}"
                    )

        for name, pod_source in POD_SOURCES.items():
            if name in CORE_POD_SOURCES or name in self.values:
                continue
            label, source = self.pod_value(pod, name)
            if label is not None:
                value = _port_number(label, source) if pod_source.parse == "port" else label
                self.set(name, value, source)

    def _connector_from_label(self, pod: PodInfo, engine: str) -> None:
        label, source = self.pod_value(pod, "kv_connector")
        fallback = str(self.get("default_kv_connector")).strip().lower()
        name = DIALECTS.connector_name(label) if label is not None else None
        if name is not None and name in DIALECTS.connectors():
            self.set("kv_connector", name, source)
            return
        via = self.source_of("default_kv_connector")
        self.set(
            "kv_connector",
            fallback,
            SOURCE_DEFAULT if via == SOURCE_DEFAULT else f"default_kv_connector ({via})",
        )
        # Engines without connectors ignore the label; without pod info none can be missed.
        if not uses_connectors(engine) or not self.pod_read:
            return
        if label is None:
            why = f"no {source}"
        else:
            known = ", ".join([*DIALECTS.connectors(), *sorted(DIALECTS.connector_aliases())])
            why = f"{source}={label!r} is not a known connector ({known})"
        self.warnings.append(f"{why}; using default_kv_connector {fallback!r}")

    def follow(self, name: str, leader: str) -> None:
        """Name ``leader``'s source for ``name`` when nothing set it (``Settings`` fills its
        value from ``leader``'s)."""
        via = self.source_of(leader)
        if name not in self.values and via != SOURCE_DEFAULT:
            self.sources[name] = f"{leader} ({via})"

    def source_of(self, name: str) -> str:
        return self.sources.get(name, SOURCE_DEFAULT)


def _validation_message(exc: ValidationError, values: Mapping[str, Any], res: _Resolver) -> str:
    problems = []
    for error in exc.errors():
        loc = error.get("loc", ())
        name = str(loc[0]) if loc else "settings"
        value = values.get(name, error.get("input"))
        reason = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        problems.append(f"invalid {name} {value!r} (from {res.source_of(name)}): {reason}")
    return "; ".join(problems)


def _read_pod(res: _Resolver) -> PodInfo | None:
    """The pod's labels and annotations; None when no readable directory is configured."""
    podinfo_dir = res.get("podinfo_dir")
    if not podinfo_dir:
        return None
    if not os.path.isdir(podinfo_dir):  # noqa: PTH112 (a str from the user; stat only)
        # Not fatal: a pod without the volume still runs on flags and env, but say so.
        res.warnings.append(
            f"podinfo_dir {podinfo_dir!r} (from {res.source_of('podinfo_dir')}) is not a "
            "directory; no labels or annotations read"
        )
        return None
    try:
        return read_podinfo(podinfo_dir)
    except PodInfoError as exc:
        raise ConfigError(f"pod info: {exc}") from None


def load_settings(args: argparse.Namespace, environ: Mapping[str, str]) -> LoadedSettings:
    """Build the settings; ``ConfigError`` names any bad value and where it came from."""
    values, sources = _explicit(args, environ)
    res = _Resolver(values, sources)
    res.warnings.extend(unknown_variable_warnings(
        environ, ENV_PREFIX, [env_for(name) for name in field_names()]))
    pod = _read_pod(res)
    res.apply_pod(pod)
    res.follow("prefill_data_parallel_size", "data_parallel_size")
    try:
        settings = Settings(**res.values)
    except ValidationError as exc:
        raise ConfigError(_validation_message(exc, res.values, res)) from None
    check_engine_registered(settings, res)
    check_ports(settings, res)
    check_connector_engine(settings, res)
    check_tls(settings, res)
    check_prompt_length_source(settings, res)
    check_tracing(settings, res)
    check_kv_events(settings, res)
    warning = data_parallel_warning(settings, res)
    if warning is not None:
        res.warnings.append(warning)
    res.warnings.extend(allowlist_name_warnings(settings, res))
    all_sources = {name: res.source_of(name) for name in field_names()}
    return LoadedSettings(settings, MappingProxyType(all_sources), tuple(res.warnings))
