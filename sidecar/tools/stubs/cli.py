"""The stub engine as a command: ``python -m sidecar.tools.stubs`` / ``disagg-sidecar stub-engine``.

    python -m sidecar.tools.stubs --engine vllm --role prefill --kv-connector shfs --port 8100
    -> prints one JSON line when listening:
       {"event": "listening", "engine": "vllm", ..., "port": 8100, "bootstrap_port": null}
    and runs until SIGINT or SIGTERM. ``--transport lean`` serves the same behaviour on the
    benchmark's cheap server (vLLM NIXL and SGLang only); ``--faults-endpoint`` serves
    ``/_stub/faults`` (aiohttp only), which is off by default; ``--kv-events-endpoint``
    publishes the vLLM stub's prefix cache (``--kv-cache-blocks``) as vLLM's KV events.

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
from sidecar.dialects.sglang import SGLangOptions
from sidecar.dialects.vllm_mooncake import MooncakeOptions
from sidecar.tools.stubs.config import (
    ENGINES,
    MOONCAKE_QUERY_SHAPES,
    ROLES,
    STREAM_WRITES,
    TRANSPORTS,
    VLLM_CONNECTORS,
    StubConfig,
)
from sidecar.tools.stubs.faults import Fault, FaultKind
from sidecar.tools.stubs.lean.server import run_lean
from sidecar.tools.stubs.server import run_stub

#: The sidecar's default bootstrap port for SGLang and vLLM Mooncake prefills (the same).
SIDECAR_BOOTSTRAP_PORT = SGLangOptions().sglang_bootstrap_port


def add_stub_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the stub engine's flags to ``parser`` (every one with a help text and its
    default)."""
    d = StubConfig()
    add = parser.add_argument
    # Names are case-insensitive, as serve's are (--role Decode).
    add("--engine", choices=ENGINES, default=d.engine, type=str.lower,
        help="the engine to behave like (default: %(default)s)")
    add("--role", choices=ROLES, default=d.role, type=str.lower,
        help="prefill, decode or both (serves either leg) (default: %(default)s)")
    add("--kv-connector", choices=VLLM_CONNECTORS, default=d.kv_connector, type=str.lower,
        help="vLLM only: shfs (NIXL pull), nixl (Neuron), mooncake, nixl-push (default: "
        "%(default)s)")
    add("--host", default=d.host, help="address to listen on (default: %(default)s)")
    add("--port", type=int, default=d.port,
        help="engine port, 0: OS-chosen (default: %(default)s)")
    add("--bootstrap-port", type=int, default=None,
        help="SGLang / vLLM Mooncake prefill bootstrap server port (0: OS-chosen; default: "
        f"{SIDECAR_BOOTSTRAP_PORT}, the sidecar's --sglang-bootstrap-port and "
        "--mooncake-bootstrap-port default)")
    add("--model", default=d.model, help="served model name (default: %(default)s)")
    add("--model-root", default=d.model_root,
        help="where the model's weights came from, as /v1/models says it (its root; another "
        "revision under the same name differs here; default: the model name)")
    add("--kv-cache-dtype", default=d.kv_cache_dtype,
        help="vLLM: the KV cache's dtype its /metrics states (vllm:cache_config_info; "
        "default: %(default)s)")
    add("--max-model-len", type=int, default=d.max_model_len,
        help="context length: longer prompts get the engine's 400 (default: %(default)s)")
    add("--default-max-tokens", type=int, default=d.default_max_tokens,
        help="tokens generated when a request names none (default: %(default)s)")
    add("--block-size", type=int, default=d.block_size,
        help="KV block size in tokens: the hand-off's block ids, the prefix cache's blocks "
        "(default: %(default)s)")
    add("--kv-cache-blocks", type=int, default=d.kv_cache_blocks,
        help="vLLM: the prefix cache's size in blocks of --block-size tokens; a request "
        "that needs room evicts the least recently used (default: %(default)s)")
    add("--kv-events-endpoint", default=None, metavar="URL",
        help="vLLM: publish the prefix cache's KV events (BlockStored, BlockRemoved, "
        "AllBlocksCleared) as vLLM 0.32's --kv-events-config does, to this ZMQ endpoint: "
        "connects to tcp://IP:PORT (e.g. the sidecar's --kv-events-endpoint, which the "
        "sidecar binds), binds tcp://*:PORT, [::] and ipc:// ones (default: none)")
    add("--kv-events-topic", default=d.kv_events_topic,
        help="vLLM: the topic of each KV event message, as --kv-events-config's topic "
        "(default: none)")
    add("--enable-prompt-tokens-details", action="store_true",
        help="vLLM: usage reports the prefix cache's figures (prompt_tokens_details."
        "cached_tokens), as vLLM's flag of that name (default: off)")
    add("--eos-rate", type=int, default=d.eos_rate,
        help="stop with EOS with chance 1/N at each token after the first (deterministic "
        "per prompt), 0: never (default: %(default)s)")
    add("--ttft", type=float, default=d.ttft_s,
        help="seconds before the first token (default: %(default)s)")
    add("--itl", type=float, default=d.itl_s,
        help="seconds between tokens (default: %(default)s)")
    add("--kv-lease", type=float, default=d.kv_lease_s,
        help="vLLM NIXL: seconds a prefill holds its blocks for a decode (default: "
        "%(default)s)")
    add("--pull-timeout", type=float, default=d.pull_timeout_s,
        help="seconds a decode waits to pull KV or query a bootstrap server (default: "
        "%(default)s)")
    add("--bootstrap-timeout", type=float, default=d.bootstrap_timeout_s,
        help="SGLang: seconds a prefill waits for its decode (default: %(default)s)")
    add("--waiting-timeout", type=float, default=d.waiting_timeout_s,
        help="SGLang and vLLM Mooncake: seconds a decode waits for its prefill (default: "
        "%(default)s)")
    add("--mooncake-query-shape", choices=MOONCAKE_QUERY_SHAPES, default=d.mooncake_query_shape,
        help="vLLM Mooncake: the bootstrap /query answer's shape (default: %(default)s)")
    add("--side-channel-host", default=d.side_channel_host,
        help="vLLM NIXL: the host a prefill names in its hand-off (default: %(default)s)")
    add("--data-parallel-size", type=int, default=d.data_parallel_size,
        help="ranks behind the one API server (each honours and records the rank a request "
        "names, as the engine does) (default: %(default)s)")
    add("--keepalive", type=float, default=d.keepalive_s,
        help="seconds an idle client connection stays open (default: %(default)s)")
    add("--record-limit", type=int, default=d.record_limit,
        help="requests kept for /_stub/requests, 0: none (default: %(default)s)")
    add("--secret", default=d.secret,
        help="TensorRT-LLM: the opaque state's key, the same for every stub of a pair "
        "(default: %(default)s)")
    add("--transport", choices=TRANSPORTS, default=d.transport,
        help="aiohttp (every engine, faults, recording) or lean (the bench's) (default: "
        "%(default)s)")
    add("--stream-writes", choices=STREAM_WRITES, default=d.stream_writes,
        help="lean: an unpaced stream is written a write per event, or whole in one write "
        "(the bytecode count's: one read at the sidecar whatever the timing) (default: "
        "%(default)s)")
    add("--faults-endpoint", action="store_true",
        help="serve /_stub/faults so another process can switch faults (default: off)")
    add("--tls-cert-file", default=None, metavar="PEM",
        help="serve HTTPS on --port with this certificate chain (with --tls-key-file; the "
        "bootstrap port stays plain HTTP; default: plain HTTP)")
    add("--tls-key-file", default=None, metavar="PEM",
        help="the private key of --tls-cert-file")
    add("--tls-client-ca-file", default=None, metavar="PEM",
        help="ask HTTPS clients for a certificate signed by this CA bundle (mutual TLS; "
        "default: no client certificate asked for)")
    kinds = ", ".join(kind.value for kind in FaultKind)
    add("--fault", action="append", default=[], metavar="JSON",
        help="a fault switch, repeatable: a JSON object with kind (one of: "
        f"{kinds}) and optionally path, times, status, message, delay_s, after_chunks, "
        "size; e.g. '{\"kind\": \"status\", \"status\": 503, \"times\": 1}' (default: "
        "none)")


def _bootstrap_port(args: argparse.Namespace) -> int:
    """The flag's port, else the sidecar's default for a prefill that runs a bootstrap
    server, so that a stub and a sidecar started with their defaults meet."""
    if args.bootstrap_port is not None:
        return int(args.bootstrap_port)
    if args.role == "decode":
        return 0
    if args.engine == "sglang":
        return SGLangOptions().sglang_bootstrap_port
    if args.engine == "vllm" and args.kv_connector == "mooncake":
        return MooncakeOptions().mooncake_bootstrap_port
    return 0


def config_from_args(args: argparse.Namespace) -> StubConfig:
    faults = tuple(Fault.from_json(jsonutil.loads(text)) for text in args.fault)
    return StubConfig(
        engine=args.engine,
        role=args.role,
        kv_connector=args.kv_connector,
        host=args.host,
        port=args.port,
        bootstrap_port=_bootstrap_port(args),
        model=args.model,
        model_root=args.model_root,
        kv_cache_dtype=args.kv_cache_dtype,
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
        stream_writes=args.stream_writes,
        control_faults=args.faults_endpoint,
        tls_cert_file=args.tls_cert_file,
        tls_key_file=args.tls_key_file,
        tls_client_ca_file=args.tls_client_ca_file,
        prompt_tokens_details=args.enable_prompt_tokens_details,
        kv_cache_blocks=args.kv_cache_blocks,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_topic=args.kv_events_topic,
    )


def announce(line: dict[str, Any]) -> None:
    """``line`` as one JSON line on stdout, in one write: stubs started side by side on one
    terminal or pipe (the docs' try-it blocks) cannot split each other's lines. ``print``
    writes the text and its newline apart when stdout is unbuffered (``PYTHONUNBUFFERED``),
    and another process's line could land between them."""
    sys.stdout.flush()  # anything written through the text layer goes first
    sys.stdout.buffer.write(jsonutil.dumps(line) + b"\n")
    sys.stdout.buffer.flush()


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
            announce({"event": "listening", **stub.info(), "url": stub.url})
            await stop.wait()
    except OSError as exc:
        print(f"stub-engine: cannot listen: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # an endpoint ZMQ refused
        print(f"stub-engine: {exc}", file=sys.stderr)
        return 2
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
