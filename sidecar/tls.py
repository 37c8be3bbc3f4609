"""Optional TLS: the server certificate (reloaded when its files change) and the engine CA.

    tls_cert_file + tls_key_file ─▶ ReloadingServerTLS
        .context            one ssl.SSLContext for the HTTP site (HTTPS on the HTTP port)
        .grpc_credentials() grpc dynamic credentials (TLS on the gRPC port)
        .watch()            every tls_reload_interval_s: check_now()
        .check_now()        files changed? load the new pair INTO the same context (new
                            handshakes use it; open connections keep theirs) and bump the
                            generation the gRPC fetcher hands out on the next connection
    engine_ca_file ─▶ client_ssl_context() for the upstream session (engines, prefill targets)

A change is seen by stat (mtime, size, inode), which also catches Kubernetes' symlink swap of
a mounted secret. The new pair is read once into memory and checked on a scratch context
before it touches the live one: a half-written or mismatched pair is logged and the old one
kept, so a bad rotation never takes the listener down.

Deliberate limits: no client-certificate (mutual TLS) checks and no insecure modes (an
engine over https is always verified, against ``engine_ca_file`` or the system store); the
separate metrics port stays plaintext; TLS 1.2 is the floor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
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
    """One certificate chain and its key, as loaded; ``generation`` counts loads."""

    cert: bytes
    key: bytes
    stamps: tuple[_Stamp, _Stamp]
    generation: int


def _stamp(path: str) -> _Stamp:
    st = Path(path).stat()  # follows symlinks: a swapped secret's target changes its stamp
    return _Stamp(st.st_mtime_ns, st.st_size, st.st_ino)


@contextlib.contextmanager
def _as_paths(cert: bytes, key: bytes) -> Iterator[tuple[str, str]]:
    """``load_cert_chain`` takes paths only; give it paths to the exact bytes we checked.

    Memory files where the OS has them (a read-only root filesystem needs no writable
    temp directory, and the key never touches a disk); else a private temp directory.
    """
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


def _new_server_context() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


class ReloadingServerTLS:
    """The server side: one SSLContext and gRPC credentials that follow the files."""

    def __init__(self, cert_file: str, key_file: str, reload_interval_s: float = 10.0) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.reload_interval_s = reload_interval_s
        self.context = _new_server_context()
        pair = self._read(generation=1)
        self._load(self.context, pair)
        self._pair = pair
        self._grpc_seen = 0  # the generation the gRPC fetcher last handed out

    @property
    def generation(self) -> int:
        """1 after start, +1 for each pair loaded since."""
        return self._pair.generation

    def _read(self, generation: int) -> _Pair:
        try:
            stamps = (_stamp(self.cert_file), _stamp(self.key_file))
            cert = Path(self.cert_file).read_bytes()
            key = Path(self.key_file).read_bytes()
        except OSError as exc:
            raise TLSFileError(f"tls_cert_file/tls_key_file: cannot read: {exc}") from None
        return _Pair(cert, key, stamps, generation)

    def _load(self, context: ssl.SSLContext, pair: _Pair) -> None:
        try:
            with _as_paths(pair.cert, pair.key) as (cert_path, key_path):
                context.load_cert_chain(cert_path, key_path)
        except (OSError, ssl.SSLError) as exc:
            raise TLSFileError(
                f"tls_cert_file {self.cert_file!r} / tls_key_file {self.key_file!r}: "
                f"not a matching PEM certificate chain and key: {exc}"
            ) from None

    def check_now(self) -> bool:
        """Reload if the files changed; True when a new pair is now served."""
        try:
            stamps = (_stamp(self.cert_file), _stamp(self.key_file))
        except OSError as exc:
            logger.warning("TLS files unreadable, keeping the current certificate: %s", exc)
            return False
        if stamps == self._pair.stamps:
            return False
        try:
            pair = self._read(self._pair.generation + 1)
            # A scratch context first: a failed load_cert_chain can leave the live context
            # with the new certificate and the old key.
            self._load(_new_server_context(), pair)
            self._load(self.context, pair)
        except TLSFileError as exc:
            logger.error("TLS reload refused, keeping the current certificate: %s", exc)
            # Remember the stamps so a broken pair is reported once, not every interval.
            self._pair = _Pair(self._pair.cert, self._pair.key, stamps, self._pair.generation)
            return False
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
        return grpc.ssl_server_certificate_configuration([(pair.key, pair.cert)])

    def _grpc_fetch(self) -> grpc.ServerCertificateConfiguration | None:
        # gRPC calls this before every new connection's handshake: it must be cheap and
        # never raise. check_now() swaps ``_pair`` in one assignment, so a read is whole.
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
            self._grpc_config(), self._grpc_fetch  # type: ignore[arg-type]
        )


def client_ssl_context(ca_file: str) -> ssl.SSLContext:
    """Verify upstream servers (engines, prefill targets) against ``ca_file``, TLS >= 1.2."""
    try:
        context = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise TLSFileError(f"engine_ca_file {ca_file!r}: not a readable PEM CA bundle: {exc}") \
            from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context
