"""Optional TLS: the server certificate and client CA (reloaded when their files change), and
the upstream client's context (engine CA, client certificate).

    tls_cert_file + tls_key_file [+ tls_client_ca_file] ─▶ ReloadingServerTLS
        .context / .grpc_credentials()   the HTTP site's SSLContext, the gRPC port's credentials
        .watch()                         every tls_reload_interval_s: check_now()
        .check_now()                     files changed? a fresh context serves new handshakes
    engine_ca_file, engine_client_cert_file + engine_client_key_file ─▶ client_ssl_context()

Deliberate limits (docs/operating/reliability.md): no insecure modes; the metrics port
stays plaintext; TLS 1.2 is the floor; the outbound client certificate is read at start.
How a rotation is seen and switched in: docs/extending/design-notes.md#tls-reload
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import grpc

logger = logging.getLogger(__name__)


class TLSFileError(ValueError):
    """A certificate, key or CA file that cannot be read or loaded."""


class _Stamp(NamedTuple):
    mtime_ns: int
    size: int
    inode: int


@dataclass(frozen=True)
class _Pair:
    """One certificate chain, its key and the client CA as loaded (``generation`` counts
    loads; ``stamps`` are the files' stamps when they were read)."""

    cert: bytes
    key: bytes
    client_ca: bytes | None
    stamps: tuple[_Stamp, ...]
    generation: int


def _stamp(path: str) -> _Stamp:
    st = Path(path).stat()  # follows symlinks: a swapped secret's target changes its stamp
    return _Stamp(st.st_mtime_ns, st.st_size, st.st_ino)


@contextlib.contextmanager
def _as_paths(cert: bytes, key: bytes) -> Iterator[tuple[str, str]]:
    """Paths to the exact bytes we checked (``load_cert_chain`` takes paths only): memory
    files where the OS has them, else a private temp directory
    (docs/extending/design-notes.md#tls-reload)."""
    if hasattr(os, "memfd_create"):
        fds = [os.memfd_create("disagg-tls-cert"), os.memfd_create("disagg-tls-key")]
        try:
            for fd, data in zip(fds, (cert, key), strict=True):
                os.write(fd, data)
            yield f"/proc/self/fd/{fds[0]}", f"/proc/self/fd/{fds[1]}"
        finally:
            for fd in fds:
                os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix="disagg-tls-") as tmp:  # mode 0700
        cert_path, key_path = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
        cert_path.write_bytes(cert)
        key_path.write_bytes(key)
        yield str(cert_path), str(key_path)


def _new_server_context(require_client_cert: bool) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if require_client_cert:
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class ReloadingServerTLS:
    """The server side: one SSLContext and gRPC credentials that follow the files."""

    def __init__(self, cert_file: str, key_file: str, reload_interval_s: float = 10.0,
                 client_ca_file: str | None = None) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.client_ca_file = client_ca_file
        self.reload_interval_s = reload_interval_s
        pair = self._read(generation=1)
        # The listener's own context keeps its verify mode: each generation is a fresh one.
        self.context = self._build(pair)
        self._serving = self.context
        self.context.sni_callback = self._switch_context
        self._pair = pair
        self._grpc_seen = 0  # the generation the gRPC fetcher last handed out

    @property
    def require_client_cert(self) -> bool:
        return self.client_ca_file is not None

    def _files(self) -> tuple[str, ...]:
        files = (self.cert_file, self.key_file)
        return files if self.client_ca_file is None else (*files, self.client_ca_file)

    def _switch_context(
        self, connection: ssl.SSLObject | ssl.SSLSocket, server_name: str | None,
        listener: ssl.SSLContext,
    ) -> None:
        # Called in every handshake (also without SNI): the current generation's context.
        serving = self._serving
        if serving is not listener:
            connection.context = serving

    @property
    def generation(self) -> int:
        """1 after start, +1 for each pair loaded since."""
        return self._pair.generation

    def _read(self, generation: int) -> _Pair:
        try:
            stamps = tuple(_stamp(path) for path in self._files())
            cert = Path(self.cert_file).read_bytes()
            key = Path(self.key_file).read_bytes()
            client_ca = (Path(self.client_ca_file).read_bytes()
                         if self.client_ca_file is not None else None)
        except OSError as exc:
            raise TLSFileError(
                f"tls_cert_file/tls_key_file/tls_client_ca_file: cannot read: {exc}"
            ) from None
        return _Pair(cert, key, client_ca, stamps, generation)

    def _load(self, context: ssl.SSLContext, pair: _Pair) -> None:
        try:
            with _as_paths(pair.cert, pair.key) as (cert_path, key_path):
                context.load_cert_chain(cert_path, key_path)
        except (OSError, ssl.SSLError) as exc:
            raise TLSFileError(
                f"tls_cert_file {self.cert_file!r} / tls_key_file {self.key_file!r}: "
                f"not a matching PEM certificate chain and key: {exc}"
            ) from None

    def _build(self, pair: _Pair) -> ssl.SSLContext:
        """A fresh context serving ``pair`` (and trusting only its client CA)."""
        context = _new_server_context(self.require_client_cert)
        self._load(context, pair)
        if pair.client_ca is not None:
            try:
                context.load_verify_locations(cadata=_pem_ca(pair.client_ca))
            except (ValueError, ssl.SSLError) as exc:
                raise TLSFileError(f"tls_client_ca_file {self.client_ca_file!r}: not a PEM "
                                   f"CA bundle: {exc}") from None
        return context

    def check_now(self) -> bool:
        """Reload if the files changed; True when a new pair is now served."""
        try:
            stamps = tuple(_stamp(path) for path in self._files())
        except OSError as exc:
            logger.warning("TLS files unreadable, keeping the current certificate: %s", exc)
            return False
        if stamps == self._pair.stamps:
            return False
        try:
            pair = self._read(self._pair.generation + 1)
            # A fresh context first: a failed load can leave a new certificate and old key.
            fresh = self._build(pair)
            self._load(self.context, pair)
        except TLSFileError as exc:
            logger.error("TLS reload refused, keeping the current certificate: %s", exc)
            # Remember the stamps so a broken set is reported once, not every interval.
            self._pair = replace(self._pair, stamps=stamps)
            return False
        self._serving = fresh
        self._pair = pair
        logger.info("TLS certificate reloaded from %s (generation %d)",
                    self.cert_file, pair.generation)
        return True

    async def watch(self) -> None:
        """Poll the files until cancelled (``serve`` starts and stops this task)."""
        while True:
            await asyncio.sleep(self.reload_interval_s)
            self.check_now()

    def _grpc_config(self) -> grpc.ServerCertificateConfiguration:
        import grpc  # here: the config loader uses this module without the gRPC stack

        pair = self._pair
        return grpc.ssl_server_certificate_configuration([(pair.key, pair.cert)],
                                                         root_certificates=pair.client_ca)

    def _grpc_fetch(self) -> grpc.ServerCertificateConfiguration | None:
        # Before every handshake: cheap, never raising; check_now() swaps ``_pair`` whole.
        pair = self._pair
        if pair.generation == self._grpc_seen:
            return None
        self._grpc_seen = pair.generation
        return self._grpc_config()

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Credentials for ``server.add_secure_port`` that pick up reloaded pairs."""
        import grpc

        self._grpc_seen = self._pair.generation
        # The stubs say the fetcher never returns None; grpc documents None as "no change".
        return grpc.dynamic_ssl_server_credentials(
            self._grpc_config(), self._grpc_fetch,  # type: ignore[arg-type]
            require_client_authentication=self.require_client_cert)


def _pem_ca(data: bytes) -> str:
    """PEM CA certificates as ``load_verify_locations(cadata=...)`` takes them (a str; bytes
    would be read as DER). An empty bundle would trust nothing and refuse every client."""
    text = data.decode("ascii", "replace")
    if "-----BEGIN CERTIFICATE-----" not in text:
        raise ValueError("no PEM certificate in it")
    return text


def client_ssl_context(ca_file: str | None, cert_file: str | None = None,
                       key_file: str | None = None) -> ssl.SSLContext:
    """Verify upstream servers (engines, prefill targets) against ``ca_file`` (None: the
    system store), TLS >= 1.2; present ``cert_file``/``key_file`` when a server asks."""
    try:
        context = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise TLSFileError(f"engine_ca_file {ca_file!r}: not a readable PEM CA bundle: {exc}") \
            from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file is not None and key_file is not None:
        try:
            context.load_cert_chain(cert_file, key_file)
        except (OSError, ssl.SSLError) as exc:
            raise TLSFileError(
                f"engine_client_cert_file {cert_file!r} / engine_client_key_file "
                f"{key_file!r}: not a readable, matching PEM certificate chain and key: {exc}"
            ) from None
    return context
