"""``disagg-sidecar demo``: the whole PD flow on loopback, with nothing to install or run.

    prefill stub ◀─(prefill leg)── sidecar ──(decode leg)──▶ decode stub
                                      ▲
                       one streamed OpenAI request with x-prefiller-host-port

It starts a prefill stub engine, a decode stub engine and the sidecar in this process on
OS-chosen loopback ports, sends one streamed completion through the PD flow, prints both legs,
the hand-off and the answer, and exits 0 when the decode engine really used the prefill's KV.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any, TextIO

import aiohttp

from sidecar.config.settings import Settings
from sidecar.dialects import DEFAULT_CONNECTOR, DIALECTS, handoff_keys, uses_connectors
from sidecar.serve import run_server
from sidecar.tools.stubs.config import StubConfig
from sidecar.tools.stubs.server import run_stub

#: The fields each engine family's decode leg gets from the hand-off, for printing.
_HANDOFF_KEYS = handoff_keys()
_CONNECTORS = tuple(DIALECTS.connectors("vllm"))


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    # Names are case-insensitive, as serve's are (--engine VLLM).
    parser.add_argument("--engine", choices=("vllm", "sglang", "trtllm"), default="vllm",
                        type=str.lower, help="engine family of the stub pair (default: vllm)")
    parser.add_argument("--kv-connector", default=None, metavar="CONNECTOR",
                        help="vLLM only: the KV connector of the stub pair, "
                        f"{', '.join(_CONNECTORS)} or vLLM's class name (NixlConnector = shfs, "
                        "MooncakeConnector = mooncake); default: shfs")
    parser.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog.",
                        help="the prompt to send")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens to generate")


def _show(out: TextIO, title: str, payload: Any) -> None:
    text = json.dumps(payload, indent=2, sort_keys=False, default=str)
    out.write(f"\n== {title}\n{text}\n")


class DemoUsageError(ValueError):
    """A demo command line that names something the chosen engine does not use."""


def demo_connector(engine: str, given: str | None) -> str:
    """The connector of the stub pair: ``given`` (an alias resolved) for vLLM, refused for an
    engine without connectors, which would silently ignore it."""
    if not uses_connectors(engine):
        if given is not None:
            raise DemoUsageError(
                f"--kv-connector {given} is a vLLM KV connector; engine {engine} uses none "
                f"(its hand-off is its own): leave --kv-connector out, or use --engine vllm"
            )
        return DEFAULT_CONNECTOR
    connector = DIALECTS.connector_name(given) if given is not None else DEFAULT_CONNECTOR
    if connector not in _CONNECTORS:
        raise DemoUsageError(
            f"--kv-connector {given}: not a connector of engine {engine}; valid: "
            f"{', '.join(_CONNECTORS)} (or {', '.join(sorted(DIALECTS.connector_aliases()))})"
        )
    return connector


async def run_demo(args: argparse.Namespace, out: TextIO = sys.stdout,
                   err: TextIO = sys.stderr) -> int:
    """Run the demo; 0 when the answer streamed and the decode used the remote KV, 2 when the
    command line names a connector the engine does not use."""
    engine: str = args.engine
    try:
        connector = demo_connector(engine, args.kv_connector)
    except DemoUsageError as exc:
        err.write(f"disagg-sidecar demo: {exc}\n")
        return 2
    async with (
        run_stub(StubConfig(engine=engine, role="prefill", kv_connector=connector)) as prefill,
        run_stub(StubConfig(engine=engine, role="decode", kv_connector=connector)) as decode,
    ):
        bootstrap = prefill.bootstrap_port or 8998
        settings = Settings.model_validate({
            "engine": engine,
            "kv_connector": connector,
            "engine_url": decode.url,
            "host": "127.0.0.1",
            "port": 0,
            "grpc_enabled": False,
            "prefill_allowlist": (f"127.0.0.1:{prefill.port}",),
            "sglang_bootstrap_port": bootstrap,
            "mooncake_bootstrap_port": bootstrap,
            "log_level": "warning",
        })
        stop = asyncio.Event()
        listening: asyncio.Future[dict[str, int]] = asyncio.get_running_loop().create_future()
        server = asyncio.ensure_future(run_server(settings, stop, listening.set_result))
        try:
            ports = await asyncio.wait_for(asyncio.shield(listening), timeout=30)
            out.write(
                f"prefill stub   {prefill.url}  ({engine}"
                f"{'/' + connector if engine == 'vllm' else ''})\n"
                f"decode stub    {decode.url}\n"
                f"sidecar        http://127.0.0.1:{ports['http']}  (in front of the decode stub)\n"
            )
            body = {"model": "stub-model", "prompt": args.prompt,
                    "max_tokens": args.max_tokens, "stream": True}
            _show(out, "client -> sidecar  POST /v1/completions  "
                  f"x-prefiller-host-port: 127.0.0.1:{prefill.port}", body)
            answer = await _send(ports["http"], prefill.port, body)
            prefill_seen = await prefill.recorder.next_request("/v1/completions")
            decode_seen = await decode.recorder.next_request("/v1/completions")
            _show(out, "prefill leg: what the prefill engine received", prefill_seen.json)
            handoff = {k: decode_seen.json[k] for k in _HANDOFF_KEYS if k in decode_seen.json}
            _show(out, "hand-off: what the decode leg carried besides the client body", handoff)
            decision = await decode.recorder.next_decision()
            out.write(
                f"\n== decode engine: KV from {decision.outcome} prefill ({decision.reason})\n"
            )
            out.write(f"\n== answer streamed to the client\n{answer}\n")
        finally:
            stop.set()
            await server
    ok = decision.outcome == "remote" and bool(answer)
    out.write("\nPD flow OK\n" if ok else "\nPD flow FAILED: the decode did not use the hand-off\n")
    return 0 if ok else 1


async def _send(sidecar_port: int, prefill_port: int, body: dict[str, Any]) -> str:
    """Send the streamed request and join the text of its SSE chunks."""
    pieces: list[str] = []
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"http://127.0.0.1:{sidecar_port}/v1/completions",
            json=body,
            headers={"x-prefiller-host-port": f"127.0.0.1:{prefill_port}"},
        ) as response:
            if response.status != 200:
                raise RuntimeError(f"sidecar answered {response.status}: {await response.text()}")
            async for line in response.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                pieces.extend(choice.get("text", "") for choice in chunk.get("choices", []))
    return "".join(pieces)
