"""The stub engine as a command: ``python -m sidecar.tools.stubs`` / ``disagg-sidecar stub-engine``.

    python -m sidecar.tools.stubs --engine vllm --role prefill --kv-connector shfs --port 8100
    -> prints one JSON line when listening:
       {"event": "listening", "engine": "vllm", ..., "port": 8100, "bootstrap_port": null}
    and runs until SIGINT or SIGTERM. ``--transport lean`` serves the same behaviour on the
    benchmark's cheap server (vLLM NIXL and SGLang only); ``--faults-endpoint`` serves
    ``/_stub/faults`` (aiohttp only), which is off by default.

``add_stub_arguments(parser)`` adds the flags to any argparse parser (the sidecar's
``stub-engine`` subcommand); ``run_stub_command(args)`` runs it and returns the exit code.

Deliberate limits: faults given on the command line are JSON (``--fault '{"kind": ...}'``,
repeatable); everything else about faults goes through ``/_stub/faults`` at runtime.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import Any

from sidecar import jsonutil
from sidecar.tools.stubs.config import (
    ENGINES,
    MOONCAKE_QUERY_SHAPES,
    ROLES,
    TRANSPORTS,
    VLLM_CONNECTORS,
    StubConfig,
)
from sidecar.tools.stubs.faults import Fault
from sidecar.tools.stubs.lean.server import run_lean
from sidecar.tools.stubs.server import run_stub


def add_stub_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the stub engine's flags to ``parser``."""
    d = StubConfig()
    parser.add_argument("--engine", choices=ENGINES, default=d.engine)
    parser.add_argument("--role", choices=ROLES, default=d.role)
    parser.add_argument("--kv-connector", choices=VLLM_CONNECTORS, default=d.kv_connector,
                        help="vLLM only: shfs (NIXL pull), nixl (Neuron), mooncake")
    parser.add_argument("--host", default=d.host)
    parser.add_argument("--port", type=int, default=d.port, help="0: OS-chosen")
    parser.add_argument("--bootstrap-port", type=int, default=d.bootstrap_port,
                        help="SGLang / vLLM Mooncake prefill bootstrap server port (0: OS-chosen)")
    parser.add_argument("--model", default=d.model)
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len)
    parser.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens)
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--eos-rate", type=int, default=d.eos_rate)
    parser.add_argument("--ttft", type=float, default=d.ttft_s, help="seconds before token 1")
    parser.add_argument("--itl", type=float, default=d.itl_s, help="seconds between tokens")
    parser.add_argument("--kv-lease", type=float, default=d.kv_lease_s)
    parser.add_argument("--pull-timeout", type=float, default=d.pull_timeout_s)
    parser.add_argument("--bootstrap-timeout", type=float, default=d.bootstrap_timeout_s)
    parser.add_argument("--waiting-timeout", type=float, default=d.waiting_timeout_s)
    parser.add_argument(
        "--mooncake-query-shape", choices=MOONCAKE_QUERY_SHAPES, default=d.mooncake_query_shape
    )
    parser.add_argument("--side-channel-host", default=d.side_channel_host)
    parser.add_argument("--data-parallel-size", type=int, default=d.data_parallel_size,
                        help="ranks behind the one API server (each honours and records the "
                        "rank a request names, as the engine does)")
    parser.add_argument("--keepalive", type=float, default=d.keepalive_s)
    parser.add_argument("--record-limit", type=int, default=d.record_limit)
    parser.add_argument("--secret", default=d.secret)
    parser.add_argument("--transport", choices=TRANSPORTS, default=d.transport,
                        help="aiohttp (every engine, faults, recording) or lean (the bench's)")
    parser.add_argument("--faults-endpoint", action="store_true",
                        help="serve /_stub/faults so another process can switch faults")
    parser.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="JSON",
        help='a fault switch, e.g. \'{"kind": "status", "status": 503, "times": 1}\'',
    )


def config_from_args(args: argparse.Namespace) -> StubConfig:
    faults = tuple(Fault.from_json(jsonutil.loads(text)) for text in args.fault)
    return StubConfig(
        engine=args.engine,
        role=args.role,
        kv_connector=args.kv_connector,
        host=args.host,
        port=args.port,
        bootstrap_port=args.bootstrap_port,
        model=args.model,
        max_model_len=args.max_model_len,
        default_max_tokens=args.default_max_tokens,
        block_size=args.block_size,
        eos_rate=args.eos_rate,
        ttft_s=args.ttft,
        itl_s=args.itl,
        kv_lease_s=args.kv_lease,
        pull_timeout_s=args.pull_timeout,
        bootstrap_timeout_s=args.bootstrap_timeout,
        waiting_timeout_s=args.waiting_timeout,
        mooncake_query_shape=args.mooncake_query_shape,
        side_channel_host=args.side_channel_host,
        data_parallel_size=args.data_parallel_size,
        keepalive_s=args.keepalive,
        record_limit=args.record_limit,
        secret=args.secret,
        faults=faults,
        transport=args.transport,
        control_faults=args.faults_endpoint,
    )


async def run_stub_command(args: argparse.Namespace) -> int:
    """Run a stub until SIGINT/SIGTERM; returns the process exit code."""
    try:
        config = config_from_args(args)
    except (ValueError, TypeError, jsonutil.JSONDecodeError) as exc:
        print(f"stub-engine: {exc}", file=sys.stderr)
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        runner = run_stub if config.transport == "aiohttp" else run_lean
        async with runner(config) as stub:
            line: dict[str, Any] = {"event": "listening", **stub.info(), "url": stub.url}
            print(jsonutil.dumps(line).decode(), flush=True)
            await stop.wait()
    except OSError as exc:
        print(f"stub-engine: cannot listen: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sidecar.tools.stubs", description="Run one stub LLM engine."
    )
    add_stub_arguments(parser)
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a project dependency
        return asyncio.run(run_stub_command(args))
    # As ``disagg-sidecar stub-engine`` runs it; the lean transport is built for uvloop.
    return uvloop.run(run_stub_command(args))
