"""Proves a dialect from an installed package runs a whole PD flow, touching no file of the
sidecar: ``tests/dialects/plugin`` holds the package ``acme_dialect`` and its distribution
metadata (``acme_dialect-1.0.dist-info``, entry point group ``disagg_sidecar.dialects``), and
is only put on the ``PYTHONPATH`` of real ``disagg-sidecar`` processes.

- ``config`` lists the engine and shows the dialect's own setting with its source;
- HTTP: a streamed and a JSON completion through the decode sidecar run the prefill leg with
  the dialect's field (its session, named with its own setting) and the decode leg with the
  hand-off it read from the prefill's answer;
- gRPC: Prefill on a prefill sidecar and Decode on a decode sidecar carry the same fields in
  the control block, and the decode streams the engine's token ids (the dialect's token-id
  field);
- a prefill answer without the dialect's ticket is the dialect's own refusal (502
  ``invalid_handoff``).

Fake Acme engines run in the test (aiohttp on loopback) and record what they received.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web

from sidecar.grpc_gen import disagg_pb2, disagg_pb2_grpc

PLUGIN = Path(__file__).resolve().parent / "plugin"
TOKENS = [11, 12, 13]
TICKET = {"seat": 7, "carriage": "B"}


class FakeAcme:
    """An Acme engine: prefill answers with a ticket, decode needs it back."""

    def __init__(self, *, tickets: bool = True) -> None:
        self.seen: list[dict[str, Any]] = []
        self.tickets = tickets
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> FakeAcme:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = next(a[1] for a in self._runner.addresses if isinstance(a, tuple))
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @staticmethod
    async def _health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    @staticmethod
    async def _models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "acme-model"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        if body.get("max_tokens") == 1 and not body.get("stream"):  # a prefill leg
            answer: dict[str, Any] = {"id": "p", "choices": [
                {"index": 0, "text": "x", "finish_reason": "length"}]}
            if self.tickets:
                answer["acme_ticket"] = TICKET
            return web.json_response(answer)
        if body.get("acme_ticket") != TICKET:
            return web.json_response({"error": "no ticket"}, status=400)
        ids = body.get("acme_token_ids") is True
        chunks = [{"id": "d", "choices": [{"index": 0, "text": f"t{t}",
                                           **({"token_ids": [t]} if ids else {}),
                                           "finish_reason": "length" if t == TOKENS[-1]
                                           else None}]} for t in TOKENS]
        if not body.get("stream"):
            return web.json_response({"id": "d", "choices": [
                {"index": 0, "text": "".join(c["choices"][0]["text"] for c in chunks),
                 "finish_reason": "length"}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in chunks:
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGIN), env.get("PYTHONPATH")]))
    return env


@contextlib.asynccontextmanager
async def acme_sidecar(engine: FakeAcme, tmp: Path, *args: str) -> AsyncIterator[dict[str, int]]:
    """A real ``disagg-sidecar serve`` process in front of ``engine``; its bound ports."""
    ports_file = tmp / f"ports-{engine.port}.json"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sidecar", "serve", "--engine", "acme",
        "--engine-url", f"http://127.0.0.1:{engine.port}", "--host", "127.0.0.1",
        "--port", "0", "--grpc-port", "0", "--ports-file", str(ports_file),
        "--prefill-allowlist", "127.0.0.1:*", "--log-level", "info", *args,
        env=_env(), stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    try:
        while b"listening:" not in (line := await process.stderr.readline()):
            if not line:
                raise AssertionError(f"sidecar exited with {await process.wait()}")
        drain = asyncio.ensure_future(process.stderr.read())
        yield json.loads(ports_file.read_text())
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        await process.wait()
        drain.cancel()


@pytest.fixture
async def engines() -> AsyncIterator[tuple[FakeAcme, FakeAcme]]:
    prefill, decode = await FakeAcme().start(), await FakeAcme().start()
    yield prefill, decode
    await prefill.stop()
    await decode.stop()


async def test_config_names_the_plugin_engine_and_its_setting() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sidecar", "config", "--engine", "acme",
        "--acme-session-tag", "night-train", env=_env(), stdout=asyncio.subprocess.PIPE)
    out, _ = await process.communicate()
    report = json.loads(out)
    assert report["settings"]["acme_session_tag"] == {"value": "night-train",
                                                      "source": "flag --acme-session-tag"}
    assert report["warnings"] == []  # "acme" is a registered engine


@pytest.mark.parametrize("stream", [True, False])
async def test_http_pd_flow_with_the_plugins_fields(
    engines: tuple[FakeAcme, FakeAcme], tmp_path: Path, stream: bool
) -> None:
    prefill, decode = engines
    async with acme_sidecar(decode, tmp_path, "--acme-session-tag", "night") as ports, \
            aiohttp.ClientSession() as session:
        async with session.post(
            f"http://127.0.0.1:{ports['http']}/v1/completions",
            json={"model": "acme-model", "prompt": "to the coast", "max_tokens": 3,
                  "stream": stream},
            headers={"x-prefiller-host-port": f"127.0.0.1:{prefill.port}",
                     "X-Request-Id": "trip-1"},
        ) as response:
            assert response.status == 200
            text = await response.text()
    assert "t11" in text and "t13" in text
    [prefill_leg] = prefill.seen
    assert prefill_leg["acme_session"] == "night-trip-1"
    assert prefill_leg["max_tokens"] == 1 and prefill_leg["stream"] is False
    [decode_leg] = decode.seen
    assert decode_leg["acme_ticket"] == TICKET
    assert decode_leg["acme_session"] == "night-trip-1"
    assert decode_leg["stream"] is stream and decode_leg["max_tokens"] == 3


async def test_grpc_pd_flow_with_the_plugins_fields(
    engines: tuple[FakeAcme, FakeAcme], tmp_path: Path
) -> None:
    prefill, decode = engines
    async with acme_sidecar(prefill, tmp_path, "--advertise-host", "127.0.0.1") as p_ports, \
            acme_sidecar(decode, tmp_path) as d_ports:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{p_ports['grpc']}") as channel:
            stub = disagg_pb2_grpc.PrefillWorkerStub(channel)
            blocks = [m.block async for m in stub.Prefill(disagg_pb2.PreFillRequest(
                request_id="trip-2", token_ids=[1, 2, 3], max_new_tokens=3)) if not m.done]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{d_ports['grpc']}") as channel:
            stub = disagg_pb2_grpc.DecodeWorkerStub(channel)
            tokens = [m async for m in stub.Decode(disagg_pb2.DecodeRequest(
                request_id="trip-2", kv_blocks=blocks, token_ids=[1, 2, 3], max_new_tokens=3))]
    assert [m.token_id for m in tokens if not m.done] == TOKENS
    assert tokens[-1].done and tokens[-1].finish_reason == "length"
    assert prefill.seen[0]["acme_session"] == "acme-trip-2"
    assert decode.seen[0]["acme_ticket"] == TICKET
    assert decode.seen[0]["acme_session"] == "acme-trip-2"
    assert decode.seen[0]["acme_token_ids"] is True


async def test_a_prefill_without_a_ticket_is_the_dialects_refusal(tmp_path: Path) -> None:
    prefill, decode = await FakeAcme(tickets=False).start(), await FakeAcme().start()
    try:
        async with acme_sidecar(decode, tmp_path) as ports, aiohttp.ClientSession() as session:
            async with session.post(
                f"http://127.0.0.1:{ports['http']}/v1/completions",
                json={"model": "acme-model", "prompt": "p", "max_tokens": 3},
                headers={"x-prefiller-host-port": f"127.0.0.1:{prefill.port}"},
            ) as response:
                assert response.status == 502
                error = (await response.json())["error"]
        assert error["code"] == "invalid_handoff"
        assert "without a ticket" in error["message"]
        assert decode.seen == []
    finally:
        await prefill.stop()
        await decode.stop()
