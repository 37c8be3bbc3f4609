"""The streamed relay's work per read: the decode engine's bytes onto the client's socket.

    relay = SSERelay(request, response)          # after response.prepare(request)
    await exchange.pipe(relay.feed, relay.catch_up)
    relay.total, relay.tail, relay.engine_error  # what the end of the stream is judged by

``feed`` runs in the upstream connection's read callback (``PDExchange.pipe``): it writes the
bytes as one HTTP/1.1 chunk (the framing aiohttp's ``StreamResponse.write`` uses, byte for
byte; unframed for an HTTP/1.0 client, as aiohttp does) straight to the client's transport,
then does the stream's bookkeeping: bytes relayed, an engine error event in the stream, the
last bytes (for the ``[DONE]`` check). At an engine's pace every token is its own read, so
this is the path each token takes; it resolves no future, wakes no task and touches no
metric.

What needs an ``await`` runs in ``catch_up`` (the piping task): the first chunk goes through
``response.write`` so the response head leaves with it in one send, as ``_SSEResponse``
arranges; a full client socket is waited out (aiohttp's ``drain``); a client that went away
makes ``response.write`` raise as it always did.
"""

from __future__ import annotations

from typing import Final

from aiohttp import hdrs, web

#: How an engine's in-stream error event starts (vLLM's and SGLang's ``json.dumps`` shape).
ERROR_EVENT: Final = b'data: {"error"'
DATA: Final = b"data: "
#: Bytes of the stream's end kept for the ``[DONE]`` check and the error-event seam.
TAIL_BYTES: Final = 32
#: Unsent bytes above which the relay stops reading the engine: asyncio's and uvloop's
#: default write high-water mark, where aiohttp's protocol pauses writing.
SOCKET_HIGH_WATER: Final = 64 * 1024


class SSERelay:
    """One streamed response's relay state; ``feed`` and ``catch_up`` for ``pipe``."""

    __slots__ = ("_chunked", "_held", "_protocol", "_response", "_started", "_writer",
                 "engine_error", "tail", "total")

    def __init__(self, request: web.BaseRequest, response: web.StreamResponse) -> None:
        self._response = response
        # What aiohttp's prepare() chose: chunks for HTTP/1.1, the bare bytes until the
        # connection closes for an HTTP/1.0 client.
        self._chunked = response.headers.get(hdrs.TRANSFER_ENCODING, "").lower() == "chunked"
        self._protocol = request.protocol
        self._writer = request.writer
        self._held: bytes | None = None  # bytes waiting for catch_up (head not sent, or gone)
        self._started = False  # the first chunk (with the head) went through aiohttp
        self.total = 0
        self.tail = b""
        self.engine_error = False

    def feed(self, chunk: bytes) -> bool:
        """Write ``chunk`` to the client now; False when ``catch_up`` must run first."""
        transport = self._protocol.transport
        if not self._started or self._held is not None or transport is None or (
                transport.is_closing()):
            self._held = chunk if self._held is None else self._held + chunk
            return False
        transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if self._chunked else chunk)
        # _account, inlined: this runs once per token at an engine's pace.
        self.total += len(chunk)
        tail = self.tail
        if not self.engine_error and (chunk.find(ERROR_EVENT) >= 0 or (
                tail and not chunk.startswith(DATA) and carries_error_event(tail, chunk))):
            self.engine_error = True
        self.tail = chunk[-TAIL_BYTES:] if len(chunk) >= TAIL_BYTES else (tail + chunk)[
            -TAIL_BYTES:]
        # Bytes the socket did not take stay in the transport; past its high-water mark
        # (where aiohttp's protocol pauses writing) reading stops until they drain.
        return transport.get_write_buffer_size() <= SOCKET_HIGH_WATER

    async def catch_up(self) -> None:
        """Send what ``feed`` held back (through aiohttp), then wait out a full socket."""
        held = self._held
        if held is not None:
            self._held = None
            await self._response.write(held)  # raises when the client has gone
            self._started = True
            self._account(held)
        await self._writer.drain()

    def _account(self, chunk: bytes) -> None:
        self.total += len(chunk)
        tail = self.tail
        # The common case costs one substring search; the seam check runs only for a chunk
        # that does not start an event.
        if not self.engine_error and (chunk.find(ERROR_EVENT) >= 0 or (
                tail and not chunk.startswith(DATA) and carries_error_event(tail, chunk))):
            self.engine_error = True
        # Only the last bytes matter; slicing a long chunk alone avoids copying it whole.
        self.tail = chunk[-TAIL_BYTES:] if len(chunk) >= TAIL_BYTES else (tail + chunk)[
            -TAIL_BYTES:]


def carries_error_event(tail: bytes, chunk: bytes) -> bool:
    """True when ``chunk`` holds (or completes) an engine's error event.

    vLLM and SGLang end a stream that failed after its head with ``data: {"error": {...}}``
    and then ``data: [DONE]`` (both write the event with ``json.dumps``); TensorRT-LLM cuts
    the stream instead, which the missing ``[DONE]`` already tells. Text inside an event is
    JSON, where a quote is always escaped, so the marker never occurs inside a token. One
    substring search per chunk; the seam with the previous chunk is looked at only when this
    one does not start a new event (an event split across reads).
    """
    if ERROR_EVENT in chunk:
        return True
    if chunk.startswith(DATA) or not tail:
        return False
    seam = len(ERROR_EVENT) - 1
    return ERROR_EVENT in tail[-seam:] + chunk[:seam]
