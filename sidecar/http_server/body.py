"""The one reader of a client's request body, for every route: limits, decoding, deadline.

    reader = BodyReader(limits)              once per process (the app's)
    await reader.read(request)     ─▶ bytes  the whole body as the engine gets it (decoded)
    reader.stream(request)         ─▶ its chunks as they arrive (a plain body on the
                                      passthrough), or None when it must be read whole

    Content-Encoding   absent / identity  -> plain    forwarded as received
                       gzip / deflate     -> decoded  here, forwarded inflated with its own
                                                      length and no Content-Encoding
                       anything else      -> 415 unsupported_content_encoding

Every body is held to the same limits (docs/operating/reliability-rules.md, "Request bodies"):

- ``--max-body-bytes``: a declared length over it is refused before a byte is read, and a
  body that grows past it (plain bytes, or bytes inflated) is cut (413 ``body_too_large``);
- a plain body costs the sidecar what it cost the sender; an encoded one at most
  ``--max-body-inflation`` times the bytes received so far (past a first
  ``INFLATION_FLOOR`` that any body may inflate to: a small JSON compresses well), so a few
  KB of gzip cannot make the sidecar hold tens of MB (413, naming the flag);
- every body being inflated counts against one process-wide budget,
  ``--max-inflating-body-bytes``, until it has been read: past it a body is refused with 503
  ``overloaded`` (the sidecar's memory is spoken for; the client may retry), so many
  connections within their ratios cannot add up to what one may not;
- the whole body within ``--client-body-timeout-s`` (408 ``request_timeout``): a client
  trickling its body (slow loris) cannot hold an admission slot for ever;
- broken chunked framing or a broken coding: 400 ``invalid_request``, without its bytes.

Why the sidecar inflates bodies itself (aiohttp's own inflation is off: the server is built
with ``auto_decompress=False``): aiohttp hands over inflated bytes only, so a reader cannot
tell a body's cost to its sender from its cost to the sidecar; here both counts are at hand.
Forwarding inflated bytes with the client's compressed length, or with the header, is how a
body smuggled a second request into an engine's connection: an engine reads exactly the
bytes the sidecar counted.

Deliberate limits: ``br`` and ``zstd`` are refused (no engine here sends them, and their
decoders are not dependencies); an encoded passthrough body is read whole before the engine
is called, so that its length is known.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Final

from aiohttp import web
from multidict import CIMultiDictProxy

from sidecar.errors import (
    BodyTooLarge,
    InvalidRequest,
    Overloaded,
    RequestTimeout,
    UnsupportedContentEncoding,
)

CONTENT_ENCODING: Final = "Content-Encoding"
#: Any body may inflate to this many bytes whatever it was sent as.
INFLATION_FLOOR: Final = 1024 * 1024
#: Inflated bytes produced per decompression step (bounds each step's memory).
_STEP_BYTES: Final = 256 * 1024
#: zlib window bits: a gzip member, a zlib stream, and raw deflate (what some clients send
#: as "deflate": its first byte's low nibble is not 8, the zlib header's method).
_GZIP_WBITS: Final = 16 + zlib.MAX_WBITS
_ZLIB_WBITS: Final = zlib.MAX_WBITS
_RAW_WBITS: Final = -zlib.MAX_WBITS
_CODINGS: Final = {"gzip": _GZIP_WBITS, "deflate": _ZLIB_WBITS}

#: A body whose chunked framing or content coding breaks while it is read: the client's
#: fault, told without its bytes.
MALFORMED_BODY = InvalidRequest("request body framing or content coding is malformed")


@dataclass(frozen=True, slots=True)
class BodyLimits:
    """What bounds every client body (the settings' ``--max-body-bytes`` and friends)."""

    max_bytes: int
    timeout_s: float
    #: An encoded body inflates to at most this many times the bytes received.
    max_inflation: float = 20.0
    #: Inflated bytes of every body still being read, together, at most.
    inflating_budget: int = 256 * 1024 * 1024


def body_coding(headers: CIMultiDictProxy[str]) -> int | None:
    """The zlib window bits that decode the body (None: plain); raises
    ``UnsupportedContentEncoding`` for any other coding (one header, one coding)."""
    values = headers.getall(CONTENT_ENCODING, [])
    if not values:
        return None
    if len(values) == 1 and values[0].isascii():
        coding = values[0].lower()
        if coding == "identity":
            return None
        wbits = _CODINGS.get(coding)
        if wbits is not None:
            return wbits
    raise UnsupportedContentEncoding(
        "request body Content-Encoding is not supported: send it plain or with one of "
        "gzip, deflate (one Content-Encoding header, one coding)")


class BodyReader:
    """Reads client bodies within their limits (see the module docstring); ``inflating``:
    told the budget's use whenever it changes (a gauge)."""

    __slots__ = ("_inflating", "_told", "limits")

    def __init__(self, limits: BodyLimits,
                 inflating: Callable[[float], None] | None = None) -> None:
        self.limits = limits
        #: Inflated bytes held by bodies still being read (the process-wide budget's use).
        self._inflating = 0
        self._told = inflating

    @property
    def inflating(self) -> int:
        return self._inflating

    def encoded(self, request: web.BaseRequest) -> bool:
        """True when the body must be decoded (so read whole before it is forwarded);
        ``UnsupportedContentEncoding`` for a coding the sidecar does not decode."""
        return body_coding(request.headers) is not None

    async def read(self, request: web.BaseRequest) -> bytes:
        """The whole body as the engine gets it (decoded), within every limit."""
        wbits = body_coding(request.headers)
        self._check_declared(request)
        content = request.content
        if wbits is None and content.is_eof():
            # All there already (its declared length was checked): taken as it is, with no
            # await and no copy loop (aiohttp's ``read`` refuses an oversized chunked body
            # with its own text/plain 413; here it is the taxonomy's).
            try:
                body = content.read_nowait()
            except web.RequestPayloadError:
                raise MALFORMED_BODY from None
            if len(body) > self.limits.max_bytes:
                raise BodyTooLarge(f"request body exceeds {self.limits.max_bytes} bytes "
                                   "(--max-body-bytes)")
            return body
        try:
            async with asyncio.timeout(self.limits.timeout_s):
                if wbits is None:
                    return b"".join([chunk async for chunk in self._plain(request)])
                return await self._inflated(request, wbits)
        except TimeoutError:
            raise self._late() from None

    def stream(self, request: web.BaseRequest) -> AsyncIterator[bytes] | None:
        """A plain body's chunks as they arrive, within the limits; None when it is encoded
        (``read`` it whole) or absent."""
        if body_coding(request.headers) is not None or not request.body_exists:
            return None
        self._check_declared(request)
        return self._streamed(request)

    # -- the parts ----------------------------------------------------------------------------

    def _check_declared(self, request: web.BaseRequest) -> None:
        length = request.content_length
        if length is not None and length > self.limits.max_bytes:
            raise BodyTooLarge(f"request body exceeds {self.limits.max_bytes} bytes "
                               "(--max-body-bytes)")

    async def _streamed(self, request: web.BaseRequest) -> AsyncIterator[bytes]:
        """``_plain`` within one deadline for the whole body."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.timeout_s
        chunks = self._plain(request)
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    chunk = await anext(chunks, None)
            except TimeoutError:
                raise self._late() from None
            if chunk is None:
                return
            yield chunk

    async def _plain(self, request: web.BaseRequest) -> AsyncIterator[bytes]:
        max_bytes = self.limits.max_bytes
        received = 0
        content = request.content
        while True:
            try:
                chunk = await content.readany()
            except web.RequestPayloadError:
                raise MALFORMED_BODY from None
            if not chunk:
                return
            received += len(chunk)
            if received > max_bytes:
                raise BodyTooLarge(f"request body exceeds {max_bytes} bytes (--max-body-bytes)")
            yield chunk

    async def _inflated(self, request: web.BaseRequest, wbits: int) -> bytes:
        inflater: zlib._Decompress | None = None
        out = bytearray()
        sent = 0
        held = 0  # this body's share of the process-wide budget
        try:
            async for chunk in self._plain(request):
                sent += len(chunk)
                if inflater is None:
                    # "deflate" whose first byte is no zlib header is raw deflate.
                    raw = wbits == _ZLIB_WBITS and chunk[0] & 0x0F != 8
                    inflater = zlib.decompressobj(_RAW_WBITS if raw else wbits)
                data = chunk
                while data:
                    try:
                        piece = inflater.decompress(data, _STEP_BYTES)
                    except zlib.error:
                        raise MALFORMED_BODY from None
                    data = inflater.unconsumed_tail
                    if not piece:
                        break
                    out += piece
                    held = self._hold(held, len(out))
                    self._check_inflated(len(out), sent)
            if inflater is None:
                return b""
            if not inflater.eof or inflater.unused_data:
                raise MALFORMED_BODY  # a truncated stream, or bytes after its end
            return bytes(out)
        finally:
            if held:
                self._inflating -= held
                if self._told is not None:
                    self._told(self._inflating)

    def _hold(self, held: int, size: int) -> int:
        """Count this body's ``size`` inflated bytes against the budget (it held ``held``)."""
        grown = size - held
        if self._inflating + grown > self.limits.inflating_budget:
            raise Overloaded(
                f"the sidecar is inflating {self._inflating} bytes of compressed request "
                f"bodies, its budget (--max-inflating-body-bytes "
                f"{self.limits.inflating_budget}) is spoken for: retry, or send the body "
                "uncompressed")
        self._inflating += grown
        if self._told is not None:
            self._told(self._inflating)
        return size

    def _check_inflated(self, size: int, sent: int) -> None:
        limits = self.limits
        if size > limits.max_bytes:
            raise BodyTooLarge(f"request body inflates past {limits.max_bytes} bytes "
                               "(--max-body-bytes)")
        if size > INFLATION_FLOOR and size > limits.max_inflation * sent:
            raise BodyTooLarge(
                f"compressed request body inflates more than {limits.max_inflation:g} times "
                f"the bytes sent (--max-body-inflation): {size} bytes from {sent}")

    def _late(self) -> RequestTimeout:
        return RequestTimeout(f"request body not received within {self.limits.timeout_s:g} s "
                              "(--client-body-timeout-s)")
