"""Proves the KV-events settings (sidecar/config/kv_events_settings.py, checks.check_kv_events)
through the real loader:

- defaults: no endpoint, no replay, every topic, the documented cap;
- endpoints from flag, env and pod annotation (flag over env over annotation);
- loopback TCP addresses (IPv4 and IPv6) and ipc paths are accepted; any other address is
  refused with a message naming the value, its source and the opt-in flag, and accepted with
  ``--kv-events-allow-remote``; wildcard, host names, other schemes and bad ports are refused
  whatever the opt-in;
- refused combinations: a replay endpoint or the cache rule
  (``--local-prefill-max-uncached-tokens``) without an endpoint, more than one worker, a
  data-parallel local engine.

It does not prove the sockets (tests/kv_events/test_subscriber.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from config_builders import load, write_podinfo

from sidecar.config.kv_events_settings import DEFAULT_MAX_BLOCKS
from sidecar.config.loader import ConfigError


def refused(argv: list[str], env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load(argv, env)
    return str(info.value)


def test_defaults() -> None:
    settings = load([]).settings
    assert settings.kv_events_endpoint is None
    assert settings.kv_events_replay_endpoint is None
    assert settings.kv_events_topic is None
    assert settings.kv_events_allow_remote is False
    assert settings.kv_events_max_blocks == DEFAULT_MAX_BLOCKS == 131_072


@pytest.mark.parametrize(
    "endpoint", ["tcp://127.0.0.1:5557", "tcp://127.0.0.2:0", "tcp://[::1]:5557",
                 "ipc:///tmp/kv-events", "ipc://@abstract"])
def test_local_endpoints_are_accepted(endpoint: str) -> None:
    loaded = load(["--kv-events-endpoint", endpoint, "--kv-events-replay-endpoint", endpoint,
                   "--kv-events-topic", "kv", "--kv-events-max-blocks", "64"])
    assert loaded.settings.kv_events_endpoint == endpoint
    assert loaded.settings.kv_events_replay_endpoint == endpoint
    assert loaded.settings.kv_events_topic == "kv"
    assert loaded.settings.kv_events_max_blocks == 64


def test_sources_flag_env_annotation(tmp_path: Path) -> None:
    pod = write_podinfo(tmp_path, annotations={
        "model.aibrix.ai/kv-events-endpoint": "tcp://127.0.0.1:7001",
        "model.aibrix.ai/kv-events-replay-endpoint": "tcp://127.0.0.1:7002",
    })
    loaded = load([], podinfo=pod)
    assert loaded.settings.kv_events_endpoint == "tcp://127.0.0.1:7001"
    assert loaded.sources["kv_events_endpoint"] == \
        "annotation model.aibrix.ai/kv-events-endpoint"
    assert loaded.settings.kv_events_replay_endpoint == "tcp://127.0.0.1:7002"
    loaded = load([], {"DISAGG_KV_EVENTS_ENDPOINT": "tcp://127.0.0.1:7003"}, podinfo=pod)
    assert loaded.settings.kv_events_endpoint == "tcp://127.0.0.1:7003"
    loaded = load(["--kv-events-endpoint", "ipc:///run/kv"],
                  {"DISAGG_KV_EVENTS_ENDPOINT": "tcp://127.0.0.1:7003"}, podinfo=pod)
    assert loaded.settings.kv_events_endpoint == "ipc:///run/kv"
    assert loaded.sources["kv_events_endpoint"] == "flag --kv-events-endpoint"


@pytest.mark.parametrize("flag", ["--kv-events-endpoint", "--kv-events-replay-endpoint"])
def test_an_address_off_loopback_needs_the_opt_in(flag: str) -> None:
    argv = [flag, "tcp://10.1.2.3:5557"]
    if flag != "--kv-events-endpoint":
        argv += ["--kv-events-endpoint", "tcp://127.0.0.1:5557"]
    message = refused(argv)
    assert "tcp://10.1.2.3:5557" in message
    assert f"flag {flag}" in message
    assert "--kv-events-allow-remote" in message
    assert "\n" not in message
    allowed = load([*argv, "--kv-events-allow-remote"]).settings
    assert "tcp://10.1.2.3:5557" in (allowed.kv_events_endpoint,
                                     allowed.kv_events_replay_endpoint)


@pytest.mark.parametrize(
    ("endpoint", "complaint"),
    [
        ("tcp://*:5557", "wildcard"),
        ("tcp://localhost:5557", "not an IP address"),
        ("tcp://127.0.0.1", "tcp://IP:PORT"),
        ("tcp://127.0.0.1:99999", "tcp://IP:PORT"),
        ("inproc://kv", "tcp://IP:PORT or ipc://PATH"),
        ("http://127.0.0.1:5557", "tcp://IP:PORT or ipc://PATH"),
        ("ipc://", "needs a path"),
    ],
)
def test_malformed_endpoints(endpoint: str, complaint: str) -> None:
    message = refused(["--kv-events-endpoint", endpoint, "--kv-events-allow-remote"])
    assert complaint in message
    assert "kv_events_endpoint" in message and "flag --kv-events-endpoint" in message


def test_refused_combinations() -> None:
    assert "needs --kv-events-endpoint" in refused(
        ["--kv-events-replay-endpoint", "tcp://127.0.0.1:5558"])
    message = refused(["--local-prefill-max-uncached-tokens", "256"])
    assert "local_prefill_max_uncached_tokens (from flag --local-prefill-max-uncached-tokens)" \
        in message and "needs --kv-events-endpoint" in message
    assert load(["--local-prefill-max-uncached-tokens", "256", "--kv-events-endpoint",
                 "tcp://127.0.0.1:5557"]).settings.local_prefill_max_uncached_tokens == 256
    message = refused(["--kv-events-endpoint", "tcp://127.0.0.1:5557", "--workers", "2"])
    assert "needs --workers 1" in message and "flag --workers" in message
    message = refused(["--kv-events-endpoint", "tcp://127.0.0.1:5557", "--engine", "vllm",
                       "--data-parallel-size", "2"])
    assert "needs --data-parallel-size 1" in message
