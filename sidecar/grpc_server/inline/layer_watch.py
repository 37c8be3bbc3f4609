"""Layer notices on the prefill side: which layer files of one request the engine has finished.

    with LayerNotices(staging_root, key) as notices:     binds <root>/.<key>.notify (datagrams)
        ... engine's SidecarKVConnector: write layer-NNNN.kv atomically, sendto "<key> <NNNN>"
        notices.highest           the highest layer announced so far (-1: none)
        await notices.wait()      returns after a notice or a ``wake()`` (e.g. engine answered)
    # socket closed and unlinked on exit, whatever the exit

Deliberate limits: a path too long for ``sun_path`` (about 107 bytes) disables the notices
(the layers then stream once the engine answers); the socket is mode 0660. Why a datagram
socket, and why a lost notice is harmless: docs/extending/design-notes.md#layer-notices
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from pathlib import Path
from types import TracebackType

from connectors.inline_layout import NOTICE_MAX_BYTES, notice_path, parse_notice

logger = logging.getLogger(__name__)


class LayerNotices:
    """The notices of one request's layers (see the module docstring)."""

    def __init__(self, root: Path, key: str) -> None:
        self.key = key
        self.path = notice_path(root, key)
        #: The highest layer a notice announced (-1: none yet).
        self.highest = -1
        self._event = asyncio.Event()
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def listening(self) -> bool:
        return self._sock is not None

    def __enter__(self) -> LayerNotices:
        self.open()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def open(self) -> None:
        """Bind and start listening; on any OS error, log and run without notices."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        bound = False
        try:
            sock.setblocking(False)
            sock.bind(str(self.path))
            bound = True
            self.path.chmod(0o660)
            loop = asyncio.get_running_loop()
            loop.add_reader(sock.fileno(), self._drain)
        except OSError as exc:
            sock.close()
            if bound:  # the file is ours; a failed bind (e.g. EADDRINUSE) created nothing
                with contextlib.suppress(OSError):
                    self.path.unlink()
            logger.warning(
                "inline KV %s: no layer notices (%s); layers stream once the engine answers",
                self.key, exc)
            return
        self._sock, self._loop = sock, loop

    def close(self) -> None:
        """Stop listening and remove the socket file (idempotent, never raises OSError)."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(sock.fileno())
        sock.close()
        with contextlib.suppress(OSError):
            self.path.unlink()

    def wake(self) -> None:
        """Wake ``wait()`` (e.g. the engine answered: every remaining layer is readable)."""
        self._event.set()

    async def wait(self) -> None:
        """Return once a notice or a ``wake()`` came since the last return."""
        await self._event.wait()
        self._event.clear()

    def _drain(self) -> None:
        sock = self._sock
        if sock is None:
            return
        while True:
            try:
                data = sock.recv(NOTICE_MAX_BYTES + 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # pragma: no cover - a datagram socket has no peer to lose
                logger.warning("inline KV %s: notice socket failed: %s", self.key, exc)
                return
            parsed = parse_notice(data)
            if parsed is None or parsed[0] != self.key:
                logger.debug("inline KV %s: ignored notice %r", self.key, data[:64])
                continue
            if parsed[1] > self.highest:
                self.highest = parsed[1]
            self._event.set()

