"""The reader's side of one upstream exchange: a response whose head has arrived.

    UpstreamResponse ── status, headers, header(), content_length
                     ── readany() / read() / pipe(sink, catch_up) ─▶ body bytes
                     ── release() (keep the connection if clean) / close() (drop it)

``pipe(sink, catch_up)`` is the relay's way: the body bytes of each read go to ``sink`` from
the read callback itself, with no future resolved, no task woken and no coroutine resumed per
read (at an engine's pace every token is its own read: those wake-ups were most of the
relay's cost per token). A sink that cannot take more (the client's socket is full, or it
needs an ``await``) answers False: reading pauses and ``catch_up()`` runs in the piping task
before reading resumes.

Either way the connection goes back to its pool (``release``) exactly once: when the body
ended, or when the caller releases or closes the response.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from sidecar.http1.connection import Connection
from sidecar.http1.errors import UpstreamError


class UpstreamResponse:
    """A response whose head has arrived; read its body, then release or close it."""

    __slots__ = ("_conn", "_release", "content_length", "headers", "status")

    def __init__(
        self, conn: Connection, release: Callable[[Connection], None]
    ) -> None:
        self.status = conn.status
        self.headers = conn.headers
        self.content_length: int | None = None
        for name, value in self.headers:
            if name.lower() == "content-length":
                try:
                    self.content_length = int(value)
                except ValueError:
                    self.content_length = None
                break
        self._conn: Connection | None = conn
        self._release = release

    def header(self, name: str) -> str | None:
        """The first header called ``name`` (case-insensitive), or None."""
        lower = name.lower()
        for key, value in self.headers:
            if key.lower() == lower:
                return value
        return None

    async def readany(self) -> bytes:
        """The body bytes that have arrived (waiting for some); b"" once the body ended.

        Raises ``UpstreamBroken``/``UpstreamProtocolError`` when the connection failed and
        ``TimeoutError`` when no byte came within the read deadline.
        """
        conn = self._conn
        if conn is None:
            return b""
        while True:
            # A complete response stands even if bytes after it broke the connection (the
            # error then only keeps the connection out of the pool).
            if conn.has_body:
                data = conn.take_body()
                if conn.complete:
                    self._give_back(conn)
                return data
            if conn.complete:
                self._give_back(conn)
                return b""
            if conn.error is not None:
                raise conn.error
            await conn.wait_body()

    async def peek(self) -> bytes:
        """The body bytes that have arrived (waiting for some), left for the next read;
        b"" once the body ended without any. Raises as ``readany()`` does."""
        conn = self._conn
        if conn is None:
            return b""
        while not conn.has_body:
            if conn.complete:
                return b""
            if conn.error is not None:
                raise conn.error
            await conn.wait_body()
        return conn.peek_body()

    async def pipe(
        self, sink: Callable[[bytes], bool], catch_up: Callable[[], Awaitable[None]]
    ) -> None:
        """Give the rest of the body to ``sink``, each read's bytes from the read callback.

        ``sink(data)`` returns False when it takes no more for now; reading then pauses until
        ``await catch_up()`` (run here, in the caller's task) returns. The first bytes are
        awaited here and given to ``sink`` from this task (what a sink needs an await for is
        usually the first bytes: a response head to send with them). Returns when the body
        ended; raises as ``readany()`` does, and whatever ``catch_up`` raises.
        """
        # The first bytes are awaited as readany() would: a sink usually needs an await for
        # them (the client's response head leaves with them), and reading need not pause.
        first = await self.readany()
        if first and not sink(first):
            await catch_up()
        conn = self._conn
        if conn is None:  # the body ended with its first bytes: readany() gave it back
            return
        conn.set_sink(sink)
        try:
            while True:
                error = conn.error
                if error is not None and not isinstance(error, UpstreamError):
                    raise error  # the sink's own failure in the read callback, as itself
                if conn.has_body:  # bytes that arrived before the sink was set
                    if not sink(conn.take_body()):
                        conn.sink_refused()
                    continue
                if conn.sink_full:
                    await catch_up()
                    conn.sink_caught_up()
                    continue
                if conn.complete:
                    break
                if conn.error is not None:
                    raise conn.error
                await conn.wait_body()
        finally:
            conn.set_sink(None)
        self._give_back(conn)

    async def read(self, max_bytes: int | None = None) -> bytes:
        """The whole body; with ``max_bytes``, stops once more than that has arrived."""
        parts: list[bytes] = []
        size = 0
        while chunk := await self.readany():
            parts.append(chunk)
            size += len(chunk)
            if max_bytes is not None and size > max_bytes:
                break
        return b"".join(parts)

    def release(self) -> None:
        """Done with this response: keep the connection when it ended cleanly, else close."""
        conn = self._conn
        if conn is not None:
            self._give_back(conn)

    def close(self) -> None:
        """Drop the connection now (the engine sees the client go away). Idempotent."""
        conn = self._conn
        if conn is not None:
            conn.close()
            self._give_back(conn)

    def _give_back(self, conn: Connection) -> None:
        self._conn = None
        self._release(conn)

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()
