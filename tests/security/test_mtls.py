"""Proves mutual TLS on the front doors (``--tls-client-ca-file``), over HTTP and gRPC.

- A client without a certificate, with one signed by another CA, or with an expired one
  from the right CA is refused at the handshake: no HTTP answer, gRPC UNAVAILABLE. (Over
  TLS 1.3 the client learns of the refusal on its first read, so the HTTP checks also pin
  TLS 1.2, where the handshake itself fails.)
- A client with a certificate of the configured CA is served on both ports.
- Rotation without a restart: replacing the server pair and the client CA and taking one
  reload step (``check_now``, the poll task's step, called directly) makes new connections
  get the new server certificate and accept only clients of the new CA (the old CA's
  clients are refused); open connections keep what they had.
- The separate metrics port stays plain HTTP and asks for no certificate.
- Configuration: a client CA without a server pair, an unreadable CA and one client file
  without the other are refused at start.

CAs and certificates are made in the test (``cryptography``).
"""

from __future__ import annotations

import argparse
import ssl
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tls_builders import CertAuthority, Issued, client_context, tls_sidecar

from sidecar.config.loader import ConfigError, LoadedSettings, add_settings_arguments, load_settings


@dataclass(frozen=True)
class PKI:
    directory: Path
    server_ca_file: Path
    #: What the sidecar is configured with; rotations overwrite these three files.
    cert_file: Path
    key_file: Path
    client_ca_file: Path
    first_server: Issued
    second_server: Issued
    client_ca: CertAuthority
    rotated_client_ca: CertAuthority
    #: Client certificates (cert, key) on disk.
    good: tuple[Path, Path]
    foreign: tuple[Path, Path]
    expired: tuple[Path, Path]
    rotated: tuple[Path, Path]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PKI]:
    out = tmp_path_factory.mktemp("mtls")
    server_ca = CertAuthority.create("server-ca")
    client_ca, other_ca = CertAuthority.create("client-ca"), CertAuthority.create("other-ca")
    rotated_ca = CertAuthority.create("rotated-client-ca")

    def server(name: str) -> Issued:
        return server_ca.issue(name, dns=[name, "localhost"], ips=["127.0.0.1"], server=True)

    yield PKI(
        directory=out,
        server_ca_file=server_ca.write_cert(out),
        cert_file=out / "served.pem",
        key_file=out / "served.key",
        client_ca_file=out / "clients-ca.pem",
        first_server=server("first.test"),
        second_server=server("second.test"),
        client_ca=client_ca,
        rotated_client_ca=rotated_ca,
        good=client_ca.issue("router", client=True).write(out, "good"),
        foreign=other_ca.issue("router", client=True).write(out, "foreign"),
        expired=client_ca.issue("router", client=True, expired=True).write(out, "expired"),
        rotated=rotated_ca.issue("router", client=True).write(out, "rotated"),
    )


def install(pki: PKI, server: Issued, client_ca: CertAuthority) -> None:
    pki.cert_file.write_bytes(server.cert_pem)
    pki.key_file.write_bytes(server.key_pem)
    pki.client_ca_file.write_bytes(client_ca.cert_pem)


def mtls_settings(pki: PKI) -> dict[str, object]:
    return {"engine_url": "http://127.0.0.1:9", "tls_cert_file": str(pki.cert_file),
            "tls_key_file": str(pki.key_file), "tls_client_ca_file": str(pki.client_ca_file)}


# --- probes -------------------------------------------------------------------------------

async def https_health(port: int, pki: PKI, pair: tuple[Path, Path] | None, *,
                       tls12: bool = False) -> int:
    """GET /health over a new connection presenting ``pair``; the status, or raises."""
    context = client_context(pki.server_ca_file, pair)
    if tls12:
        context.maximum_version = ssl.TLSVersion.TLSv1_2
    connector = aiohttp.TCPConnector(ssl=context, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.get(f"https://127.0.0.1:{port}/health") as response:
            await response.read()
            return response.status


async def assert_https_refused(port: int, pki: PKI, pair: tuple[Path, Path] | None) -> None:
    for tls12 in (False, True):
        with pytest.raises(aiohttp.ClientError):
            await https_health(port, pki, pair, tls12=tls12)


async def grpc_health(port: int, pki: PKI, pair: tuple[Path, Path] | None,
                      name: str = "localhost") -> int:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki.server_ca_file.read_bytes(),
        private_key=pair[1].read_bytes() if pair else None,
        certificate_chain=pair[0].read_bytes() if pair else None,
    )
    options = [("grpc.ssl_target_name_override", name)]
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials, options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        return int(response.status)


async def assert_grpc_refused(port: int, pki: PKI, pair: tuple[Path, Path] | None) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await grpc_health(port, pki, pair)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


# --- serving ------------------------------------------------------------------------------

HEALTH_STATES = (health_pb2.HealthCheckResponse.SERVING,
                 health_pb2.HealthCheckResponse.NOT_SERVING)


async def test_only_clients_of_the_configured_ca_are_served(pki: PKI) -> None:
    install(pki, pki.first_server, pki.client_ca)
    async with tls_sidecar(**mtls_settings(pki)) as (sidecar, _):
        http_port, grpc_port = sidecar.ports["http"], sidecar.grpc_port
        assert await https_health(http_port, pki, pki.good) == 200
        assert await https_health(http_port, pki, pki.good, tls12=True) == 200
        # The engine (port 9) is down: NOT_SERVING, but answered over mutual TLS.
        assert await grpc_health(grpc_port, pki, pki.good) in HEALTH_STATES
        for refused in (None, pki.foreign, pki.expired):
            await assert_https_refused(http_port, pki, refused)
            await assert_grpc_refused(grpc_port, pki, refused)


async def test_a_rotated_client_ca_and_pair_take_effect_without_a_restart(pki: PKI) -> None:
    install(pki, pki.first_server, pki.client_ca)
    async with tls_sidecar(**mtls_settings(pki)) as (sidecar, tls):
        http_port, grpc_port = sidecar.ports["http"], sidecar.grpc_port
        await grpc_health(grpc_port, pki, pki.good, "first.test")
        # A connection opened before the rotation keeps what it had.
        context = client_context(pki.server_ca_file, pki.good)
        kept = aiohttp.TCPConnector(ssl=context, limit=1)
        async with aiohttp.ClientSession(connector=kept) as old_session:
            async with old_session.get(f"https://127.0.0.1:{http_port}/health") as response:
                assert response.status == 200
                await response.read()

            install(pki, pki.second_server, pki.rotated_client_ca)
            assert tls.check_now() is True
            assert tls.generation == 2

            assert await https_health(http_port, pki, pki.rotated) == 200
            assert await grpc_health(grpc_port, pki, pki.rotated, "second.test") \
                in HEALTH_STATES
            with pytest.raises(grpc.aio.AioRpcError):  # the new pair is not first.test
                await grpc_health(grpc_port, pki, pki.rotated, "first.test")
            # The old CA is no longer trusted (a fresh context, not one with a CA added).
            await assert_https_refused(http_port, pki, pki.good)
            await assert_grpc_refused(grpc_port, pki, pki.good)

            async with old_session.get(f"https://127.0.0.1:{http_port}/health") as response:
                assert response.status == 200

        # A broken CA file is refused and the current generation kept.
        pki.client_ca_file.write_bytes(b"not a certificate\n")
        assert tls.check_now() is False
        assert tls.generation == 2
        assert await https_health(http_port, pki, pki.rotated) == 200
        await assert_https_refused(http_port, pki, pki.good)


async def test_the_metrics_port_stays_plain_without_client_certificates(pki: PKI) -> None:
    install(pki, pki.first_server, pki.client_ca)
    async with tls_sidecar(metrics_port=0, **mtls_settings(pki)) as (sidecar, _):
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{sidecar.ports['metrics']}/metrics"
            async with session.get(url) as response:
                assert response.status == 200
                assert "disagg_inflight_requests" in await response.text()


# --- configuration ----------------------------------------------------------------------

def load(argv: Sequence[str], env: Mapping[str, str] | None = None) -> LoadedSettings:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    return load_settings(parser.parse_args(list(argv)), dict(env or {}))


def test_bad_mutual_tls_configurations_are_refused_at_start(pki: PKI, tmp_path: Path) -> None:
    install(pki, pki.first_server, pki.client_ca)
    server = ["--tls-cert-file", str(pki.cert_file), "--tls-key-file", str(pki.key_file)]
    with pytest.raises(ConfigError, match=r"tls_client_ca_file .*needs tls_cert_file"):
        load(["--tls-client-ca-file", str(pki.client_ca_file)])
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(b"nothing here\n")
    with pytest.raises(ConfigError, match="tls_client_ca_file"):
        load([*server, "--tls-client-ca-file", str(garbage)])
    with pytest.raises(ConfigError, match="cannot read"):
        load([*server, "--tls-client-ca-file", str(tmp_path / "missing.pem")])
    with pytest.raises(ConfigError, match=r"engine_client_cert_file.*both or neither"):
        load(["--engine-client-cert-file", str(pki.good[0])])
    with pytest.raises(ConfigError, match=r"engine_client_cert_file.*both or neither"):
        load([], {"DISAGG_ENGINE_CLIENT_KEY_FILE": str(pki.good[1])})
    with pytest.raises(ConfigError, match="engine_client_cert_file"):
        load(["--engine-client-cert-file", str(pki.good[0]),
              "--engine-client-key-file", str(pki.foreign[1])])
    loaded = load([*server, "--tls-client-ca-file", str(pki.client_ca_file),
                   "--engine-client-cert-file", str(pki.good[0]),
                   "--engine-client-key-file", str(pki.good[1])])
    assert loaded.settings.tls_client_ca_file == str(pki.client_ca_file)
    assert loaded.sources["engine_client_key_file"] == "flag --engine-client-key-file"
