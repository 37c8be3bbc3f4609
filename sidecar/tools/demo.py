"""``disagg-sidecar demo``: the whole PD flow on loopback, with nothing to install or run.

    prefill stub ◀─(prefill leg)── sidecar ──(decode leg)──▶ decode stub
                                      ▲
                       one streamed OpenAI request with x-prefiller-host-port

It starts a prefill stub engine, a decode stub engine and the sidecar in this process on
OS-chosen loopback ports, sends one streamed completion through the PD flow, prints both legs,
the hand-off and the answer, and exits 0 when the decode engine really used the prefill's KV.

``--cache-aware`` (vLLM): the decode stub keeps a prefix cache and publishes its KV events, the
sidecar indexes them and applies the cache rule (``--local-prefill-max-uncached-tokens``); a
chat's first turn runs as a pair, its second turn, whose prompt the decode engine already
holds but for the new message, runs whole there (``local_cached``): each turn's
``x-disagg-placement`` header is printed, and the exit is 0 when the second turn never
reached the prefill engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
from pathlib import Path
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
    parser.add_argument("--cache-aware", action="store_true",
                        help="vLLM: two chat turns through a sidecar that indexes the decode "
                        "engine's KV events; the second runs locally on the cached prefix")


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
        if args.cache_aware:
            _check_cache_aware(engine, connector)
    except DemoUsageError as exc:
        err.write(f"disagg-sidecar demo: {exc}\n")
        return 2
    if args.cache_aware:
        return await _run_cache_aware(args, out)
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


# -- the cache-aware demo -----------------------------------------------------------------

#: The stub's tokens are bytes: the first turn (about 210 tokens with its chat template) is
#: over a rule of 128 uncached tokens, the second's new part (the reply, one short message,
#: their template: about 80) under it.
_BLOCK_SIZE = 16
_MAX_UNCACHED = 128
_SYSTEM_PROMPT = ("You are a careful assistant for a platform team that runs "
                  "prefill/decode-disaggregated LLM serving on Kubernetes. Answer briefly.")
_INDEX_WAIT_S = 10.0
_APPLIED = re.compile(rb'^disagg_kv_event_batches_total\{outcome="applied"\} ([0-9.e+]+)$', re.M)


def _check_cache_aware(engine: str, connector: str) -> None:
    if engine != "vllm" or connector != DEFAULT_CONNECTOR:
        raise DemoUsageError(
            f"--cache-aware: the vLLM stub with NixlConnector (shfs) publishes KV events; "
            f"not engine {engine} with {connector}: leave --engine and --kv-connector out"
        )


async def _run_cache_aware(args: argparse.Namespace, out: TextIO) -> int:
    with tempfile.TemporaryDirectory(prefix="disagg-demo-") as tmp:
        endpoint = f"ipc://{Path(tmp) / 'kv-events'}"  # the engine binds, the sidecar connects
        decode_config = StubConfig(
            engine="vllm", role="decode", kv_connector=DEFAULT_CONNECTOR,
            block_size=_BLOCK_SIZE, kv_events_endpoint=endpoint, kv_events_topic="kv",
            prompt_tokens_details=True)
        async with (
            run_stub(StubConfig(engine="vllm", role="prefill",
                                kv_connector=DEFAULT_CONNECTOR)) as prefill,
            run_stub(decode_config) as decode,
        ):
            settings = Settings.model_validate({
                "engine": "vllm", "kv_connector": DEFAULT_CONNECTOR, "engine_url": decode.url,
                "host": "127.0.0.1", "port": 0, "grpc_enabled": False,
                "prefill_allowlist": (f"127.0.0.1:{prefill.port}",),
                "kv_events_endpoint": endpoint, "kv_events_topic": "kv",
                "local_prefill_max_uncached_tokens": _MAX_UNCACHED, "log_level": "warning",
            })
            stop = asyncio.Event()
            listening: asyncio.Future[dict[str, int]] = asyncio.get_running_loop().create_future()
            server = asyncio.ensure_future(run_server(settings, stop, listening.set_result))
            try:
                ports = await asyncio.wait_for(asyncio.shield(listening), timeout=30)
                sidecar = f"http://127.0.0.1:{ports['http']}"
                out.write(
                    f"prefill stub   {prefill.url}  (vllm/{DEFAULT_CONNECTOR})\n"
                    f"decode stub    {decode.url}  (prefix cache of {_BLOCK_SIZE}-token blocks,"
                    f" KV events on {endpoint})\n"
                    f"sidecar        {sidecar}  (--local-prefill-max-uncached-tokens "
                    f"{_MAX_UNCACHED})\n"
                )
                async with aiohttp.ClientSession() as session:
                    ok = await _two_turns(session, sidecar, prefill, decode.url, args, out)
            finally:
                stop.set()
                await server
    out.write("\ncache-aware placement OK\n" if ok else
              "\ncache-aware placement FAILED: the second turn did not run locally\n")
    return 0 if ok else 1


async def _two_turns(session: aiohttp.ClientSession, sidecar: str, prefill: Any,
                     decode_url: str, args: argparse.Namespace, out: TextIO) -> bool:
    """The chat's two turns; True when the second ran locally, with no prefill leg."""
    await _until_indexed(session, sidecar, decode_url)
    headers = {"x-prefiller-host-port": f"127.0.0.1:{prefill.port}"}
    messages: list[dict[str, str]] = [{"role": "system", "content": _SYSTEM_PROMPT},
                                      {"role": "user", "content": args.prompt}]
    legs_before = _prefill_legs(prefill)
    applied = await _applied_batches(session, sidecar)
    reply, placement, _ = await _chat_turn(session, sidecar, headers, messages, args.max_tokens)
    first_legs = _prefill_legs(prefill) - legs_before
    out.write(f"\n== turn 1: {len(messages)} messages\nx-disagg-placement: {placement}\n"
              f"prefill legs: {first_legs}\n")
    # The engine publishes the blocks of turn one after its answer: wait for the batch.
    async with asyncio.timeout(_INDEX_WAIT_S):
        # The index's progress is only observable by scraping: there is no event to wait on.
        while await _applied_batches(session, sidecar) == applied:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    messages += [{"role": "assistant", "content": reply},
                 {"role": "user", "content": "And in one word?"}]
    legs_before = _prefill_legs(prefill)
    _, placement, cached = await _chat_turn(session, sidecar, headers, messages, args.max_tokens)
    second_legs = _prefill_legs(prefill) - legs_before
    out.write(f"\n== turn 2: {len(messages)} messages (turn 1, its reply, one more)\n"
              f"x-disagg-placement: {placement}\nprefill legs: {second_legs}\n"
              f"cached prompt tokens the decode engine reported: {cached}\n")
    return first_legs == 1 and second_legs == 0 and placement.startswith("local_cached")


async def _chat_turn(session: aiohttp.ClientSession, sidecar: str, headers: dict[str, str],
                     messages: list[dict[str, str]], max_tokens: int) -> tuple[str, str, int]:
    """One non-streamed chat turn: its reply, its placement header, its cached tokens."""
    body = {"model": "stub-model", "messages": messages, "max_tokens": max_tokens}
    async with session.post(f"{sidecar}/v1/chat/completions", json=body,
                            headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"sidecar answered {response.status}: {await response.text()}")
        answer = await response.json()
        placement = response.headers.get("x-disagg-placement", "(no header)")
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    return (answer["choices"][0]["message"]["content"], placement,
            int(details.get("cached_tokens") or 0))


async def _until_indexed(session: aiohttp.ClientSession, sidecar: str, decode_url: str) -> None:
    """Until the sidecar's subscription carries batches: ZMQ drops what a publisher sends
    before a subscriber's subscription reaches it, so warm-up requests go to the decode stub
    directly until one of their batches is applied."""
    async with asyncio.timeout(_INDEX_WAIT_S):
        for attempt in range(1, 1_000):
            warm_up = {"model": "stub-model", "prompt": [attempt] * _BLOCK_SIZE, "max_tokens": 1}
            async with session.post(f"{decode_url}/v1/completions", json=warm_up) as response:
                await response.read()
            if await _applied_batches(session, sidecar):
                return
            await asyncio.sleep(0.01)


async def _applied_batches(session: aiohttp.ClientSession, sidecar: str) -> float:
    async with session.get(f"{sidecar}/metrics") as response:
        text = await response.read()
    found = _APPLIED.search(text)
    return float(found.group(1)) if found else 0.0


def _prefill_legs(prefill: Any) -> int:
    """The prefill engine's generation requests (not the sidecar's GETs: kinship, probes)."""
    return sum(seen.method == "POST" for seen in prefill.recorder.requests)
