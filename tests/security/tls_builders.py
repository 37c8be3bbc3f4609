"""Tools for the TLS tests: certificate authorities made in the test, TLS engine stubs, and a
listener that records the first bytes a client sends.

    ca = CertAuthority.create("ca-a")                         # a CA key and self-signed certificate
    server = ca.issue("localhost", dns=["localhost"], ips=["127.0.0.1"], server=True)
    client = ca.issue("router", client=True, expired=True)
    server.write(tmp_path, "server") -> (cert.pem, key.pem)

    async with engine_stub(server_pair, client_ca=ca_file) as engine:   # an mTLS engine
        engine.url, engine.seen (paths answered), engine.server_names (SNI seen)

    async with first_bytes_listener() as listener:     # plain TCP, records, then closes
        ... await listener.first(2) == b"\x16\x03"      # a TLS ClientHello

    async with tls_sidecar(cert_file=..., key_file=..., tls_client_ca_file=...) as (sidecar, tls):
        tls.check_now()                                # a reload step, without waiting

Certificates are made with ``cryptography`` (EC P-256, SHA-256), valid from an hour ago for a
day unless ``expired`` (a validity window that ended an hour ago). Everything is in memory or
under the test's own temporary directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import ssl
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from sidecar_builders import RunningSidecar, sidecar_settings

from sidecar.serve import run_server, server_tls
from sidecar.tls import ReloadingServerTLS

_HOUR = datetime.timedelta(hours=1)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@dataclass(frozen=True)
class Issued:
    """A certificate (PEM) and its key (PEM)."""

    cert_pem: bytes
    key_pem: bytes

    def write(self, directory: Path, name: str) -> tuple[Path, Path]:
        cert, key = directory / f"{name}.pem", directory / f"{name}.key"
        cert.write_bytes(self.cert_pem)
        key.write_bytes(self.key_pem)
        return cert, key


@dataclass(frozen=True)
class CertAuthority:
    name: str
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def create(cls, name: str) -> CertAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _HOUR)
            .not_valid_after(now + 24 * _HOUR)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=False, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(name, key, cert)

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def write_cert(self, directory: Path) -> Path:
        path = directory / f"{self.name}.pem"
        path.write_bytes(self.cert_pem)
        return path

    def issue(
        self,
        common_name: str,
        *,
        dns: Sequence[str] = (),
        ips: Sequence[str] = (),
        server: bool = False,
        client: bool = False,
        expired: bool = False,
    ) -> Issued:
        """A leaf certificate signed by this CA, for server and/or client authentication."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        start, end = ((now - 3 * _HOUR, now - _HOUR) if expired
                      else (now - _HOUR, now + 24 * _HOUR))
        usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
            [ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                self.key.public_key()), critical=False)
        )
        names: list[x509.GeneralName] = [x509.DNSName(name) for name in dns]
        names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def client_context(ca_file: Path, pair: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    """A client context trusting ``ca_file``, presenting ``pair`` when given."""
    context = ssl.create_default_context(cafile=str(ca_file))
    if pair is not None:
        context.load_cert_chain(str(pair[0]), str(pair[1]))
    return context


# --- TLS engine stubs -------------------------------------------------------------------

@dataclass
class TLSEngine:
    url: str
    port: int
    #: Paths of the requests answered, in order.
    seen: list[str] = field(default_factory=list)
    #: Request bodies, in order.
    bodies: list[dict[str, Any]] = field(default_factory=list)
    #: The SNI name of every handshake that reached the server's callback.
    server_names: list[str | None] = field(default_factory=list)


COMPLETION = {"id": "cmpl-1", "object": "text_completion", "model": "m",
              "choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}]}


@contextlib.asynccontextmanager
async def engine_stub(pair: tuple[Path, Path] | None, *, client_ca: Path | None = None
                      ) -> AsyncIterator[TLSEngine]:
    """An engine on 127.0.0.1 over TLS with ``pair`` (requiring client certificates by
    ``client_ca`` when given), or plain HTTP without a pair: /health, /v1/models,
    /v1/completions (a JSON completion)."""
    engine = TLSEngine("", 0)
    context: ssl.SSLContext | None = None
    if pair is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(pair[0]), str(pair[1]))
        if client_ca is not None:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(cafile=str(client_ca))

        def on_sni(_conn: Any, name: str | None, _ctx: ssl.SSLContext) -> None:
            engine.server_names.append(name)

        context.sni_callback = on_sni

    async def health(request: web.Request) -> web.Response:
        engine.seen.append(request.path)
        return web.json_response({})

    async def models(request: web.Request) -> web.Response:
        engine.seen.append(request.path)
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def completions(request: web.Request) -> web.Response:
        engine.seen.append(request.path)
        engine.bodies.append(await request.json())
        return web.json_response(COMPLETION)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context).start()
    engine.port = int(runner.addresses[0][1])
    engine.url = f"{'http' if context is None else 'https'}://127.0.0.1:{engine.port}"
    try:
        yield engine
    finally:
        await runner.cleanup()


# --- a listener that records what a client sends first ----------------------------------

@dataclass
class FirstBytes:
    port: int = 0
    received: list[bytes] = field(default_factory=list)
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def _on_connect(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            self.received.append(await reader.read(16))
            self._arrived.set()
        writer.close()

    async def first(self, count: int) -> bytes:
        """The first ``count`` bytes of the first connection (waits for it, bounded)."""
        async with asyncio.timeout(10):
            await self._arrived.wait()
        return self.received[0][:count]


@contextlib.asynccontextmanager
async def first_bytes_listener() -> AsyncIterator[FirstBytes]:
    """Plain TCP on 127.0.0.1: records each connection's first read, then closes it."""
    listener = FirstBytes()
    server = await asyncio.start_server(listener._on_connect, "127.0.0.1", 0)
    listener.port = int(server.sockets[0].getsockname()[1])
    try:
        yield listener
    finally:
        server.close()
        await server.wait_closed()


#: A TLS record of type handshake (0x16), protocol major version 3: how a ClientHello starts.
TLS_HANDSHAKE_START = b"\x16\x03"


# --- the sidecar over TLS, with its reloader in the test's hands -------------------------

@contextlib.asynccontextmanager
async def tls_sidecar(**overrides: Any) -> AsyncIterator[tuple[RunningSidecar, ReloadingServerTLS]]:
    """The real sidecar (``serve.run_server``) with ``overrides``; the test gets the reloader
    so it can call ``check_now`` (the poll task's step) instead of waiting for it."""
    settings = sidecar_settings(**overrides)
    tls = server_tls(settings)
    assert tls is not None
    stop = asyncio.Event()
    listening: asyncio.Future[dict[str, int]] = asyncio.get_running_loop().create_future()
    server = asyncio.ensure_future(run_server(settings, stop, listening.set_result, tls=tls))
    await asyncio.wait({server, listening}, return_when=asyncio.FIRST_COMPLETED)
    if server.done():
        server.result()
        raise RuntimeError("sidecar stopped before listening")
    try:
        yield RunningSidecar(settings, listening.result(), stop), tls
    finally:
        stop.set()
        await server
