"""Proves the sidecar posts prompts only to the prefill targets it was told to trust.

For every refused ``x-prefiller-host-port`` (another port of an allowed IP or name, llm-d
issue 979; schemes, user info, paths, queries, percent-encoding, control characters,
unbracketed IPv6, out-of-range ports, lists and repeated headers with one foreign entry, a
name with one resolved address off the list) the client gets 400/403 and a trap listening on
the named address receives no connection at all. A name is resolved once per request and the
sidecar connects to the address it checked, so a DNS answer that changes afterwards
(rebinding) never reaches the new address. Allowed targets (exact IP, network, host name,
bracketed IPv6, a name whose every address is allowed) work. Redirects from either engine are
never followed, and proxy environment variables never reroute a request.

Does not prove anything about the engines' own outbound connections (a decode engine
pulling KV from the host named in its hand-off).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict
from sidecar_builders import RunningSidecar, running_sidecar
from ssrf_builders import fake_names, redirecting_engine, trap

from sidecar.tools.stubs.config import StubConfig
from sidecar.tools.stubs.server import Stub, run_stub

BODY = {"model": "stub-model", "prompt": "Where does this prompt go?", "max_tokens": 4}
PROXY_VARS = ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY",
              "all_proxy")


@contextlib.asynccontextmanager
async def engines(host: str = "127.0.0.1") -> AsyncIterator[tuple[Stub, Stub]]:
    async with (
        run_stub(StubConfig(engine="vllm", role="prefill", host=host)) as prefill,
        run_stub(StubConfig(engine="vllm", role="decode")) as decode,
    ):
        yield prefill, decode


@contextlib.asynccontextmanager
async def sidecar(decode: Stub, allow: list[str], **settings: Any) -> AsyncIterator[
        RunningSidecar]:
    async with running_sidecar(engine="vllm", engine_url=decode.url, grpc_enabled=False,
                               prefill_allowlist=tuple(allow), **settings) as running:
        yield running


async def post(running: RunningSidecar, target: str | list[str] | None,
               path: str = "/v1/completions") -> tuple[int, dict[str, Any]]:
    headers: CIMultiDict[str] = CIMultiDict()
    for value in [target] if isinstance(target, str) else target or []:
        headers.add("x-prefiller-host-port", value)
    async with aiohttp.ClientSession() as client, client.post(
        running.url + path, json=BODY, headers=headers
    ) as response:
        text = await response.text()
        return response.status, json.loads(text) if text.startswith("{") else {}


def code_of(payload: dict[str, Any]) -> str | None:
    error = payload.get("error")
    return error.get("code") if isinstance(error, dict) else None


# Each refused header, with {trap} and {allowed} (the prefill stub's port) filled in.
REFUSED: list[tuple[str, str | list[str], int]] = [
    ("other-port-of-allowed-ip", "127.0.0.1:{trap}", 403),
    ("other-port-of-allowed-name", "localhost:{trap}", 403),
    ("trailing-dot-name", "localhost.:{trap}", 403),
    ("ipv4-mapped-ipv6", "[::ffff:127.0.0.1]:{trap}", 403),
    ("numeric-ip-form", "2130706433:{trap}", 403),
    ("one-foreign-in-a-list", "127.0.0.1:{allowed},127.0.0.1:{trap}", 403),
    ("one-foreign-in-repeated-headers", ["127.0.0.1:{allowed}", "127.0.0.1:{trap}"], 403),
    ("scheme", "http://127.0.0.1:{trap}", 400),
    ("user-info", "user@127.0.0.1:{trap}", 400),
    ("path", "127.0.0.1:{trap}/v1/completions", 400),
    ("query", "127.0.0.1:{trap}?next=1", 400),
    ("fragment", "127.0.0.1:{trap}#x", 400),
    ("percent-encoded-colon", "127.0.0.1%3A{trap}", 400),
    ("space-inside", "127.0.0.1: {trap}", 400),
    ("unbracketed-ipv6", "::ffff:127.0.0.1:{trap}", 400),
    ("port-out-of-range", "127.0.0.1:{trap_plus_65536}", 400),
    ("signed-port", "127.0.0.1:+{trap}", 400),
    ("no-host", ":{trap}", 400),
    ("no-port", "127.0.0.1", 400),
]
CODES = {400: "invalid_request", 403: "prefill_target_not_allowed"}


@pytest.mark.parametrize(("name", "header", "status"), REFUSED, ids=[r[0] for r in REFUSED])
async def test_refused_target_receives_no_byte(name: str, header: str | list[str],
                                               status: int) -> None:
    async with engines() as (prefill, decode), trap("127.0.0.1") as t:
        allow = [f"127.0.0.1:{prefill.port}", f"localhost:{prefill.port}"]
        fill = {"trap": t.port, "allowed": prefill.port, "trap_plus_65536": t.port + 65536}
        values = [h.format(**fill) for h in ([header] if isinstance(header, str) else header)]
        async with sidecar(decode, allow) as running:
            got, payload = await post(running, values)
            assert (got, code_of(payload)) == (status, CODES[status]), payload
            await t.assert_untouched()
            assert prefill.recorder.total == 0
            assert not decode.recorder.on_path("/v1/completions")
            status_ok, _ = await post(running, f"127.0.0.1:{prefill.port}")
            assert status_ok == 200


async def test_control_characters_in_the_header_are_refused() -> None:
    async with engines() as (prefill, decode), trap("127.0.0.1") as t:
        async with sidecar(decode, [f"127.0.0.1:{prefill.port}"]) as running:
            for bad in (b"127.0.0.1:\x01%d", b"127.0.0.1:%d\x7f", b"127.0.0.1:\t%d"):
                reader, writer = await asyncio.open_connection("127.0.0.1", running.ports["http"])
                body = json.dumps(BODY).encode()
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: s\r\n"
                             b"x-prefiller-host-port: " + bad % t.port + b"\r\n"
                             b"Content-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(body) + body)
                await writer.drain()
                line = await reader.readline()
                writer.close()
                assert line.split()[1] == b"400", (bad, line)
            await t.assert_untouched()
            assert prefill.recorder.total == 0


async def test_a_name_with_one_address_off_the_list_is_refused() -> None:
    async with engines() as (_, decode), trap("127.0.0.2") as t:
        answers = {
            "mixed.ssrf.test": lambda n: ["127.0.0.1", "127.0.0.2"],
            "mixed-reversed.ssrf.test": lambda n: ["127.0.0.2", "127.0.0.1"],
        }
        async with fake_names(answers), sidecar(decode, ["127.0.0.1/32:*"]) as running:
            for name in answers:
                status, payload = await post(running, f"{name}:{t.port}")
                assert (status, code_of(payload)) == (403, "prefill_target_not_allowed")
            await t.assert_untouched()


async def test_dns_rebinding_after_the_check_never_reaches_the_new_address() -> None:
    async with engines() as (prefill, decode), trap("127.0.0.2", prefill.port) as t:
        # The first answer is the allowed prefill; every later one points at the trap.
        answers = {"rebind.ssrf.test": lambda n: ["127.0.0.1"] if n == 0 else ["127.0.0.2"]}
        async with fake_names(answers) as calls, sidecar(
            decode, [f"127.0.0.1/32:{prefill.port}"]
        ) as running:
            status, _ = await post(running, f"rebind.ssrf.test:{prefill.port}")
            assert status == 200
            assert calls["rebind.ssrf.test"] == 1  # resolved once, connected to what it checked
            assert prefill.recorder.total >= 1
            status, payload = await post(running, f"rebind.ssrf.test:{prefill.port}")
            assert (status, code_of(payload)) == (403, "prefill_target_not_allowed")
            await t.assert_untouched()


async def test_unresolvable_name_is_a_prefill_failure_not_a_hang() -> None:
    async with engines() as (_, decode), fake_names({}), sidecar(
        decode, ["nowhere.ssrf.test:*"]
    ) as running:
        status, payload = await post(running, "nowhere.ssrf.test:8000")
        assert (status, code_of(payload)) == (502, "prefill_failed")


ALLOWED: list[tuple[str, str, str]] = [
    ("exact-ip", "127.0.0.1:{port}", "127.0.0.1:{port}"),
    ("network", "127.0.0.0/8:{port}", "127.0.0.1:{port}"),
    ("network-any-port", "127.0.0.0/8:*", "127.0.0.1:{port}"),
    ("host-name", "localhost:{port}", "localhost:{port}"),
    ("host-name-case-and-dot", "localhost:{port}", "LocalHost.:{port}"),
    ("name-all-addresses-allowed", "127.0.0.0/8:{port}", "both.ssrf.test:{port}"),
]


@pytest.mark.parametrize(("name", "entry", "header"), ALLOWED, ids=[a[0] for a in ALLOWED])
async def test_allowed_targets_work(name: str, entry: str, header: str) -> None:
    async with engines() as (prefill, decode), fake_names(
        {"both.ssrf.test": lambda n: ["127.0.0.1", "127.0.0.3"]}
    ), sidecar(decode, [entry.format(port=prefill.port)]) as running:
        status, payload = await post(running, header.format(port=prefill.port))
        assert status == 200, payload
        assert payload["choices"]
        seen = await prefill.recorder.next_request("/v1/completions")
        assert seen.json["max_tokens"] == 1


async def test_bracketed_ipv6_target_works() -> None:
    async with engines(host="::1") as (prefill, decode), sidecar(
        decode, [f"[::1]:{prefill.port}"]
    ) as running:
        status, payload = await post(running, f"[::1]:{prefill.port}")
        assert status == 200, payload
        status, payload = await post(running, f"[::1]:{prefill.port + 1}")
        assert (status, code_of(payload)) == (403, "prefill_target_not_allowed")


async def test_prefill_redirect_is_not_followed() -> None:
    async with engines() as (_, decode), trap("127.0.0.1") as t, redirecting_engine(
        f"http://127.0.0.1:{t.port}/v1/completions"
    ) as port, sidecar(decode, [f"127.0.0.1:{port}"]) as running:
        status, payload = await post(running, f"127.0.0.1:{port}")
        assert (status, code_of(payload)) == (502, "prefill_failed")
        await t.assert_untouched()


async def test_decode_and_passthrough_redirects_are_not_followed() -> None:
    async with engines() as (prefill, _), trap("127.0.0.1") as t, redirecting_engine(
        f"http://127.0.0.1:{t.port}/v1/completions"
    ) as port, running_sidecar(
        engine="vllm", engine_url=f"http://127.0.0.1:{port}", grpc_enabled=False,
        prefill_allowlist=(f"127.0.0.1:{prefill.port}",),
    ) as running:
        status, payload = await post(running, f"127.0.0.1:{prefill.port}")
        assert (status, code_of(payload)) == (502, "decode_failed")
        async with aiohttp.ClientSession() as client, client.get(
            running.url + "/version", allow_redirects=False
        ) as response:
            assert response.status == 307  # relayed to the client, not followed
        await t.assert_untouched()


async def test_proxy_environment_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    async with engines() as (prefill, decode), trap("127.0.0.1") as t:
        for name in PROXY_VARS:
            monkeypatch.setenv(name, f"http://127.0.0.1:{t.port}")
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        async with sidecar(decode, [f"127.0.0.1:{prefill.port}"]) as running:
            for target in (f"127.0.0.1:{prefill.port}", None):  # PD flow and passthrough
                status, payload = await post(running, target)
                assert status == 200, payload
        await t.assert_untouched()
