"""Proves the optional TLS: HTTPS and gRPC TLS served from reloading files, engines verified.

With tls_cert_file and tls_key_file the real sidecar (``serve.run_server``) answers HTTPS on
its HTTP port (a client verifying against the test CA gets /health; plain HTTP fails) and TLS
on its gRPC port (the health service answers over ``ssl_channel_credentials``). Replacing the
files and calling ``check_now()`` (the poll task's step, called directly: no waiting) makes
new connections get the new certificate on both ports, loaded into the same SSLContext; a
broken replacement (garbage, or a key of another certificate) is refused and the old
certificate kept. The config loader refuses one file without the other and unreadable
files. Upstream: an engine over https is reached when engine_ca_file holds its CA, and
without it the sidecar answers 503 at once (never a hang, never plaintext).

Certificates are made by the ``openssl`` command (no Python crypto dependency). Does not
prove anything about mutual TLS (``test_mtls.py``) or the metrics port (plaintext by design).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import tls_builders
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sidecar_builders import RunningSidecar

from sidecar.config.loader import (
    ConfigError,
    LoadedSettings,
    add_settings_arguments,
    load_settings,
)
from sidecar.tls import ReloadingServerTLS

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")

SERVING = health_pb2.HealthCheckResponse.SERVING


# --- certificates -----------------------------------------------------------------------

def _openssl(*argv: str | Path) -> None:
    subprocess.run(["openssl", *map(str, argv)], check=True, capture_output=True)


@dataclass(frozen=True)
class CA:
    cert: Path
    key: Path

    def issue(self, out: Path, name: str, serial: int, sans: str) -> tuple[Path, Path]:
        """A server certificate and key signed by this CA; ``sans`` e.g. 'DNS:x,IP:1.2.3.4'."""
        cert, key, csr, ext = (out / f"{name}.pem", out / f"{name}.key", out / f"{name}.csr",
                               out / f"{name}.ext")
        ext.write_text(
            f"subjectAltName={sans}\nbasicConstraints=CA:FALSE\n"
            "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
            "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
        )
        _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                 "-nodes", "-keyout", key, "-out", csr, "-subj", f"/CN={name}")
        _openssl("x509", "-req", "-in", csr, "-CA", self.cert, "-CAkey", self.key,
                 "-set_serial", str(serial), "-days", "2", "-out", cert, "-extfile", ext)
        return cert, key


def make_ca(out: Path, name: str = "test-ca") -> CA:
    ca = CA(out / f"{name}.pem", out / f"{name}.key")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", ca.key, "-out", ca.cert, "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return ca


@dataclass(frozen=True)
class Certs:
    ca: CA
    #: The files the sidecar is configured with (rotations overwrite them).
    cert: Path
    key: Path
    #: First: SAN localhost; second (same CA, other serial): SAN rotated.test. Both 127.0.0.1.
    first: tuple[Path, Path]
    second: tuple[Path, Path]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    out = tmp_path_factory.mktemp("tls")
    ca = make_ca(out)
    first = ca.issue(out, "first", 1001, "DNS:localhost,IP:127.0.0.1")
    second = ca.issue(out, "second", 2002, "DNS:rotated.test,IP:127.0.0.1")
    return Certs(ca, out / "served.pem", out / "served.key", first, second)


def install(certs: Certs, pair: tuple[Path, Path]) -> None:
    certs.cert.write_bytes(pair[0].read_bytes())
    certs.key.write_bytes(pair[1].read_bytes())


def client_context(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


def channel_credentials(ca: Path) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())


def serial_of(pem: Path) -> int:
    out = subprocess.run(["openssl", "x509", "-noout", "-serial", "-in", str(pem)],
                         check=True, capture_output=True, text=True).stdout
    return int(out.strip().split("=", 1)[1], 16)


# --- the sidecar with TLS ---------------------------------------------------------------

@dataclass
class TLSSidecar:
    running: RunningSidecar
    tls: ReloadingServerTLS

    @property
    def https_url(self) -> str:
        return f"https://127.0.0.1:{self.running.ports['http']}"


@contextlib.asynccontextmanager
async def tls_sidecar(certs: Certs, **overrides: Any) -> AsyncIterator[TLSSidecar]:
    """``running_sidecar`` with the reloader handed in, so a test can call ``check_now``."""
    async with tls_builders.tls_sidecar(
        tls_cert_file=str(certs.cert), tls_key_file=str(certs.key), **overrides
    ) as (running, tls):
        yield TLSSidecar(running, tls)


async def served_serial(port: int, ca: Path, server_hostname: str = "localhost") -> int:
    """The serial of the certificate a NEW connection to ``port`` gets (verified by ``ca``)."""
    _, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=client_context(ca), server_hostname=server_hostname
    )
    try:
        peer = writer.get_extra_info("peercert")
        return int(peer["serialNumber"], 16)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await writer.wait_closed()


async def grpc_health(port: int, ca: Path, name: str) -> int:
    """Health over a new TLS channel that expects the server to be ``name``."""
    credentials = channel_credentials(ca)
    options = [("grpc.ssl_target_name_override", name)]
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials, options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        return int(response.status)


# --- serving ----------------------------------------------------------------------------

async def test_https_and_grpc_tls_serve_the_configured_certificate(certs: Certs) -> None:
    install(certs, certs.first)
    async with tls_sidecar(certs, engine_url="http://127.0.0.1:9") as sidecar:
        connector = aiohttp.TCPConnector(ssl=client_context(certs.ca.cert))
        async with aiohttp.ClientSession(connector=connector) as session:
            async with session.get(sidecar.https_url + "/health") as response:
                assert response.status == 200
                assert await response.json() == {"status": "ok"}
        # Plain HTTP on the HTTPS port gets no answer.
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.ClientError):
                async with session.get(sidecar.running.url + "/health") as response:
                    await response.read()
        # The engine (port 9) is down, so health is NOT_SERVING, but it answers over TLS.
        assert await grpc_health(sidecar.running.grpc_port, certs.ca.cert, "localhost") in (
            SERVING, health_pb2.HealthCheckResponse.NOT_SERVING)
        assert await served_serial(sidecar.running.ports["http"], certs.ca.cert) == 1001


async def test_replaced_files_reach_new_connections_and_broken_ones_are_refused(
    certs: Certs, tmp_path: Path
) -> None:
    install(certs, certs.first)
    async with tls_sidecar(certs, engine_url="http://127.0.0.1:9") as sidecar:
        http_port, grpc_port = sidecar.running.ports["http"], sidecar.running.grpc_port
        context_before = sidecar.tls.context
        assert sidecar.tls.check_now() is False  # nothing changed
        with pytest.raises(grpc.aio.AioRpcError):  # the first cert is not rotated.test
            await grpc_health(grpc_port, certs.ca.cert, "rotated.test")

        install(certs, certs.second)
        assert sidecar.tls.check_now() is True
        assert sidecar.tls.context is context_before  # reloaded into the same context
        assert sidecar.tls.generation == 2
        assert await served_serial(http_port, certs.ca.cert, "rotated.test") == 2002
        await grpc_health(grpc_port, certs.ca.cert, "rotated.test")
        with pytest.raises(grpc.aio.AioRpcError):  # the new cert is no longer localhost
            await grpc_health(grpc_port, certs.ca.cert, "localhost")

        # Broken replacements: garbage, then a key that belongs to another certificate.
        certs.cert.write_bytes(b"-----BEGIN CERTIFICATE-----\nnot base64\n")
        assert sidecar.tls.check_now() is False
        install(certs, (certs.first[0], certs.second[1]))
        assert sidecar.tls.check_now() is False
        assert sidecar.tls.generation == 2
        assert await served_serial(http_port, certs.ca.cert, "rotated.test") == 2002
        await grpc_health(grpc_port, certs.ca.cert, "rotated.test")

        # A fixed pair is taken on the next check.
        install(certs, certs.first)
        assert sidecar.tls.check_now() is True
        assert await served_serial(http_port, certs.ca.cert) == serial_of(certs.first[0])
        await grpc_health(grpc_port, certs.ca.cert, "localhost")


# --- configuration ----------------------------------------------------------------------

def load(argv: Sequence[str], env: Mapping[str, str] | None = None) -> LoadedSettings:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    return load_settings(parser.parse_args(list(argv)), dict(env or {}))


def test_one_file_without_the_other_is_refused(certs: Certs) -> None:
    install(certs, certs.first)
    with pytest.raises(ConfigError, match=r"tls_cert_file.*tls_key_file.*both or neither"):
        load(["--tls-cert-file", str(certs.cert)])
    with pytest.raises(ConfigError, match=r"tls_cert_file.*tls_key_file.*both or neither"):
        load([], {"DISAGG_TLS_KEY_FILE": str(certs.key)})


def test_unloadable_files_are_refused_at_start(certs: Certs, tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(ConfigError, match="cannot read"):
        load(["--tls-cert-file", missing, "--tls-key-file", str(certs.first[1])])
    with pytest.raises(ConfigError, match="not a matching"):
        load(["--tls-cert-file", str(certs.first[0]), "--tls-key-file", str(certs.second[1])])
    with pytest.raises(ConfigError, match="engine_ca_file"):
        load(["--engine-ca-file", missing])
    loaded = load(["--tls-cert-file", str(certs.first[0]), "--tls-key-file",
                   str(certs.first[1]), "--engine-ca-file", str(certs.ca.cert)])
    assert loaded.settings.tls_reload_interval_s == 10.0


# --- upstream ---------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def https_engine(pair: tuple[Path, Path]) -> AsyncIterator[tuple[str, list[str]]]:
    """A tiny engine over HTTPS: /health and /v1/completions; yields its URL and the paths hit."""
    seen: list[str] = []

    async def health(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.json_response({})

    async def completions(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.json_response({"id": "cmpl-1", "object": "text_completion",
                                  "choices": [{"index": 0, "text": "hi",
                                               "finish_reason": "stop"}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(pair[0]), str(pair[1]))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context).start()
    port = int(runner.addresses[0][1])
    try:
        yield f"https://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


BODY = {"model": "m", "prompt": "hello", "max_tokens": 2}


async def test_engine_over_https_verified_with_engine_ca_file(certs: Certs) -> None:
    install(certs, certs.first)
    async with https_engine(certs.first) as (engine_url, seen):
        async with tls_sidecar(certs, engine_url=engine_url,
                               engine_ca_file=str(certs.ca.cert)) as sidecar:
            connector = aiohttp.TCPConnector(ssl=client_context(certs.ca.cert))
            async with aiohttp.ClientSession(connector=connector) as session:
                async with session.get(sidecar.https_url + "/ready") as response:
                    assert response.status == 200
                async with session.post(sidecar.https_url + "/v1/completions",
                                        json=BODY) as response:
                    assert response.status == 200
                    assert (await response.json())["choices"][0]["text"] == "hi"
    assert "/v1/completions" in seen


async def test_engine_over_https_without_its_ca_fails_fast(certs: Certs) -> None:
    install(certs, certs.first)
    async with https_engine(certs.first) as (engine_url, seen):
        async with tls_sidecar(certs, engine_url=engine_url) as sidecar:
            connector = aiohttp.TCPConnector(ssl=client_context(certs.ca.cert))
            async with aiohttp.ClientSession(connector=connector) as session:
                async with session.get(sidecar.https_url + "/ready") as response:
                    assert response.status == 503
                async with session.post(sidecar.https_url + "/v1/completions",
                                        json=BODY) as response:
                    assert response.status in (502, 503)
                    assert "error" in await response.json()
    assert seen == []  # the handshake failed before any request reached the engine
