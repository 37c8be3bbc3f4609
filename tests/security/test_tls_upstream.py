"""Proves https upstreams are dialled over TLS, verified, and can present a client certificate.

- A static prefill pool entry ``https://host:port`` and an ``https://`` engine URL: the first
  bytes on the wire are a TLS handshake record (0x16 0x03), never a plaintext request (the
  pool used to be downgraded to http without a word).
- A pool entry named by DNS is dialled at the address it resolved to, and the certificate is
  verified against the configured name (the stub's certificate carries only that name): the
  PD request succeeds, the prefill engine saw that name as SNI and the prefill body.
- A pool engine whose certificate is signed by another CA gets no request (502).
- Mutual TLS to engines: with ``engine_client_cert_file``/``engine_client_key_file`` the
  sidecar's client certificate is accepted by engines that require one (prefill pool and
  decode engine, one PD request through both); without it both refuse the handshake and see
  no request.

- The upstream client verifies the name it is given for an address (a wrong one is a
  connect error) and never shares a connection verified for one name with another.

Engines are aiohttp stubs on loopback with certificates from CAs made in the test.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from sidecar_builders import running_sidecar
from ssrf_builders import fake_names
from tls_builders import (
    TLS_HANDSHAKE_START,
    CertAuthority,
    engine_stub,
    first_bytes_listener,
)

from sidecar.http1 import EngineClient, UpstreamConnectError
from sidecar.tls import client_ssl_context

BODY = {"model": "m", "prompt": "hello", "max_tokens": 4}
PREFILL_NAME = "prefill.ssrf.test"  # resolved by ssrf_builders.fake_names, to 127.0.0.1


@dataclass(frozen=True)
class PKI:
    ca_file: Path
    other_ca_file: Path
    #: SAN DNS:prefill.ssrf.test only (no IP: verification must use the configured name).
    named_server: tuple[Path, Path]
    #: SAN IP:127.0.0.1.
    ip_server: tuple[Path, Path]
    #: Signed by the other CA.
    foreign_server: tuple[Path, Path]
    #: The sidecar's client certificate (client auth), signed by ca.
    sidecar_client: tuple[Path, Path]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PKI]:
    out = tmp_path_factory.mktemp("upstream-tls")
    ca, other = CertAuthority.create("engine-ca"), CertAuthority.create("other-ca")
    yield PKI(
        ca_file=ca.write_cert(out),
        other_ca_file=other.write_cert(out),
        named_server=ca.issue(PREFILL_NAME, dns=[PREFILL_NAME], server=True).write(out, "n"),
        ip_server=ca.issue("engine", ips=["127.0.0.1"], server=True).write(out, "ip"),
        foreign_server=other.issue("x", dns=[PREFILL_NAME], ips=["127.0.0.1"],
                                   server=True).write(out, "foreign"),
        sidecar_client=ca.issue("sidecar", client=True).write(out, "sidecar-client"),
    )


async def post(url: str) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=BODY) as response:
            return response.status, await response.json()


# --- nothing leaves in plaintext ----------------------------------------------------------

async def test_an_https_pool_entry_is_dialled_over_tls() -> None:
    async with first_bytes_listener() as listener, engine_stub(None) as decode:
        async with running_sidecar(engine="plain", engine_url=decode.url,
                                   prefill_urls=(f"https://127.0.0.1:{listener.port}",)
                                   ) as sidecar:
            status, answer = await post(sidecar.url)
        assert await listener.first(2) == TLS_HANDSHAKE_START
    # The listener is no TLS server: the prefill leg fails and nothing reaches decode.
    assert status == 502 and answer["error"]["code"] == "prefill_failed"
    assert decode.bodies == []


async def test_an_https_engine_url_is_dialled_over_tls() -> None:
    async with first_bytes_listener() as listener:
        async with running_sidecar(engine="plain",
                                   engine_url=f"https://127.0.0.1:{listener.port}") as sidecar:
            status, _ = await post(sidecar.url)
        assert await listener.first(2) == TLS_HANDSHAKE_START
    assert status in (502, 503)


# --- verified, against the configured name ---------------------------------------------------

async def test_a_named_https_pool_entry_is_verified_against_its_name(pki: PKI) -> None:
    async with fake_names({PREFILL_NAME: lambda _: ["127.0.0.1"]}) as resolutions, \
            engine_stub(pki.named_server) as prefill, engine_stub(None) as decode:
        async with running_sidecar(engine="plain", engine_url=decode.url,
                                   engine_ca_file=str(pki.ca_file),
                                   prefill_urls=(f"https://{PREFILL_NAME}:{prefill.port}",)
                                   ) as sidecar:
            status, answer = await post(sidecar.url)
    assert status == 200, answer
    assert resolutions[PREFILL_NAME] >= 1  # the sidecar resolved it and dialled the address
    assert prefill.server_names and set(prefill.server_names) == {PREFILL_NAME}
    assert [body["max_tokens"] for body in prefill.bodies] == [1]
    assert [body["max_tokens"] for body in decode.bodies] == [4]


async def test_a_pool_engine_with_a_certificate_of_another_ca_gets_nothing(pki: PKI) -> None:
    async with engine_stub(pki.foreign_server) as prefill, engine_stub(None) as decode:
        async with running_sidecar(engine="plain", engine_url=decode.url,
                                   engine_ca_file=str(pki.ca_file),
                                   prefill_urls=(f"https://127.0.0.1:{prefill.port}",)
                                   ) as sidecar:
            status, answer = await post(sidecar.url)
    assert status == 502 and answer["error"]["code"] == "prefill_failed"
    assert prefill.seen == [] and decode.bodies == []


# --- mutual TLS to engines ---------------------------------------------------------------

async def test_engines_requiring_client_certificates_accept_the_sidecars(pki: PKI) -> None:
    async with engine_stub(pki.ip_server, client_ca=pki.ca_file) as prefill, \
            engine_stub(pki.ip_server, client_ca=pki.ca_file) as decode:
        async with running_sidecar(engine="plain", engine_url=decode.url,
                                   engine_ca_file=str(pki.ca_file),
                                   engine_client_cert_file=str(pki.sidecar_client[0]),
                                   engine_client_key_file=str(pki.sidecar_client[1]),
                                   prefill_urls=(f"https://127.0.0.1:{prefill.port}",)
                                   ) as sidecar:
            status, answer = await post(sidecar.url)
    assert status == 200, answer
    assert [body["max_tokens"] for body in prefill.bodies] == [1]
    assert [body["max_tokens"] for body in decode.bodies] == [4]


async def test_engines_requiring_client_certificates_refuse_a_sidecar_without(
    pki: PKI,
) -> None:
    async with engine_stub(pki.ip_server, client_ca=pki.ca_file) as prefill, \
            engine_stub(pki.ip_server, client_ca=pki.ca_file) as decode:
        async with running_sidecar(engine="plain", engine_url=decode.url,
                                   engine_ca_file=str(pki.ca_file),
                                   prefill_urls=(f"https://127.0.0.1:{prefill.port}",)
                                   ) as sidecar:
            status, answer = await post(sidecar.url)
            async with aiohttp.ClientSession() as session:
                async with session.get(sidecar.url + "/v1/models") as response:
                    passthrough_status = response.status
    assert status == 502 and answer["error"]["code"] == "prefill_failed"
    assert passthrough_status in (502, 503)
    assert prefill.seen == [] and decode.seen == []


# --- the upstream client itself ------------------------------------------------------------

async def test_the_client_verifies_the_given_name_and_pools_per_name(
    pki: PKI, tmp_path: Path
) -> None:
    both = CertAuthority.create("both-ca")
    pair = both.issue("p", dns=[PREFILL_NAME], ips=["127.0.0.1"], server=True).write(
        tmp_path, "both")
    context = client_ssl_context(str(both.write_cert(tmp_path)))
    async with engine_stub(pair) as engine:
        client = EngineClient(limit=8, keepalive_s=30, connect_timeout_s=5,
                              read_timeout_s=5, ssl_context=context)
        try:
            url = engine.url + "/health"
            for name in (PREFILL_NAME, None, PREFILL_NAME, None):
                async with await client.request("GET", url, server_hostname=name) as response:
                    assert response.status == 200
                    await response.read()
            # One pooled connection per verified name, each reused once.
            assert client.open_connections == 2
            assert engine.server_names == [PREFILL_NAME, None]  # no SNI for an IP
            with pytest.raises(UpstreamConnectError):
                await client.request("GET", url, server_hostname="other.ssrf.test")
        finally:
            await client.close()


# --- a failed handshake is named as such, never as a refused connection ---------------------

async def test_a_decode_engine_certificate_of_another_ca_is_reported_as_tls(
    pki: PKI, caplog: pytest.LogCaptureFixture
) -> None:
    async with engine_stub(pki.foreign_server) as decode, engine_stub(None) as prefill:
        async with running_sidecar(engine="plain", engine_url=decode.url,
                                   engine_ca_file=str(pki.ca_file),
                                   prefill_urls=(prefill.url,)) as sidecar:
            status, answer = await post(sidecar.url)
    message = answer["error"]["message"]
    # The decode leg's own failure, or (once the health check has seen it) the engine known
    # down: either way the handshake and its verification error are named.
    assert (status, answer["error"]["code"]) in {(502, "decode_failed"),
                                                 (503, "engine_not_ready")}, answer
    assert "TLS handshake" in message and "certificate verify failed" in message, message
    assert "refused" not in message
    assert any("TLS" in r.getMessage() and decode.url in r.getMessage() for r in caplog.records)


async def test_a_prefill_pool_certificate_of_another_ca_is_reported_as_tls(
    pki: PKI, caplog: pytest.LogCaptureFixture
) -> None:
    async with engine_stub(pki.foreign_server) as prefill, engine_stub(None) as decode:
        async with running_sidecar(engine="plain", engine_url=decode.url,
                                   engine_ca_file=str(pki.ca_file),
                                   prefill_urls=(f"https://127.0.0.1:{prefill.port}",)
                                   ) as sidecar:
            status, answer = await post(sidecar.url)
    message = answer["error"]["message"]
    assert status == 502 and answer["error"]["code"] == "prefill_failed", answer
    assert "TLS handshake with prefill engine failed: certificate verify failed" in message
    assert any("TLS" in r.getMessage() and f"127.0.0.1:{prefill.port}" in r.getMessage()
               for r in caplog.records)


async def test_an_https_url_to_a_plain_http_engine_says_it_serves_no_tls() -> None:
    async with engine_stub(None) as decode, engine_stub(None) as prefill:
        https_url = decode.url.replace("http://", "https://")
        async with running_sidecar(engine="plain", engine_url=https_url,
                                   prefill_urls=(prefill.url,)) as sidecar:
            status, answer = await post(sidecar.url)
    message = answer["error"]["message"]
    assert status in (502, 503) and "TLS handshake" in message, answer
    assert "does it serve TLS" in message, message
