"""Property tests of the upstream HTTP/1.1 client (``sidecar.http1``) over real sockets.

Proves: any well-formed response (any status from 200, any headers, a body framed by
Content-Length, chunked with any chunk sizes, or the connection's end), written in pieces cut
anywhere, is read back exactly, and a framed one leaves its connection reusable; any bytes at
all from a server that then hangs up end in a response or a typed ``UpstreamError``: never
another exception, never a wait past the peer's close. Any URL string (scheme, authority,
path, query and fragment pieces mixed with delimiters, spaces and control characters) names
the same target, or fails the same way, whether its origin's parse is cached apart or the
whole URL is parsed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
import uvloop
from fuzz_builders import FUZZ
from hypothesis import given
from hypothesis import strategies as st

from sidecar.http1 import EngineClient, UpstreamError
from sidecar.http1.client import parse_url, target_of

T = TypeVar("T")

TOKEN = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12).filter(
    lambda name: name not in ("content-length", "transfer-encoding", "connection")
)
VALUE = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=20)


@dataclass(frozen=True)
class Answer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    framing: str  # "length", "chunked" or "close"
    chunk_sizes: list[int]

    def encode(self) -> bytes:
        lines = [f"HTTP/1.1 {self.status} X"] + [f"{k}: {v}" for k, v in self.headers]
        if self.framing == "length":
            lines.append(f"Content-Length: {len(self.body)}")
            payload = self.body
        elif self.framing == "chunked":
            lines.append("Transfer-Encoding: chunked")
            payload = b""
            rest = self.body
            for size in self.chunk_sizes:
                if not rest:
                    break
                piece, rest = rest[:size], rest[size:]
                payload += b"%x\r\n%s\r\n" % (len(piece), piece)
            if rest:
                payload += b"%x\r\n%s\r\n" % (len(rest), rest)
            payload += b"0\r\n\r\n"
        else:
            lines.append("Connection: close")
            payload = self.body
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


ANSWERS = st.builds(
    Answer,
    status=st.integers(200, 599).filter(lambda s: s not in (204, 304)),
    headers=st.lists(st.tuples(TOKEN, VALUE), max_size=6),
    body=st.binary(max_size=4096),
    framing=st.sampled_from(["length", "chunked", "close"]),
    chunk_sizes=st.lists(st.integers(1, 700), max_size=8),
)
CUTS = st.lists(st.integers(0, 6000), max_size=6)
#: Both loops the sidecar runs on (asyncio's in the tests, uvloop in ``serve``).
LOOPS = st.sampled_from([asyncio.new_event_loop, uvloop.new_event_loop])


def _run(loop: Callable[[], asyncio.AbstractEventLoop], main: Coroutine[Any, Any, T]) -> T:
    with asyncio.Runner(loop_factory=loop) as runner:
        return runner.run(main)


def _pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(cut, len(data)) for cut in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


async def _exchange(raw: bytes, cuts: list[int], close_after: bool, requests: int
                    ) -> tuple[list[tuple[int, list[tuple[str, str]], bytes]], int]:
    """Serve ``raw`` per request (cut into pieces); returns what the client read and how
    many connections the server saw."""
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                for piece in _pieces(raw, cuts):
                    writer.write(piece)
                    await writer.drain()
                if close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    http = EngineClient(limit=4, keepalive_s=30.0, connect_timeout_s=5.0, read_timeout_s=5.0)
    got: list[tuple[int, list[tuple[str, str]], bytes]] = []
    try:
        for _ in range(requests):
            response = await http.request("GET", f"http://127.0.0.1:{port}/x", timeout_s=5.0)
            try:
                got.append((response.status, response.headers, await response.read()))
            finally:
                response.release()
    finally:
        await http.close()
        server.close()
    return got, connections


@FUZZ
@given(ANSWERS, CUTS, LOOPS)
def test_any_well_formed_answer_is_read_exactly(
    answer: Answer, cuts: list[int], loop: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    framed = answer.framing != "close"
    got, connections = _run(loop, _exchange(
        answer.encode(), cuts, close_after=not framed, requests=2 if framed else 1
    ))
    for status, headers, body in got:
        assert status == answer.status
        assert body == answer.body
        for name, value in answer.headers:
            assert (name, value) in headers
    assert connections == 1  # a framed answer leaves its connection to the next request


@FUZZ
@given(st.binary(max_size=600), CUTS, LOOPS)
def test_any_bytes_end_in_an_answer_or_a_typed_error(
    raw: bytes, cuts: list[int], loop: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    async def one() -> None:
        # TimeoutError (a wait past the server's close) or any other exception fails.
        with contextlib.suppress(UpstreamError):
            await _exchange(raw, cuts, close_after=True, requests=1)

    _run(loop, one())


@FUZZ
@given(ANSWERS, st.integers(0, 5000), CUTS, LOOPS)
def test_an_answer_cut_short_ends_in_a_typed_error(
    answer: Answer, keep: int, cuts: list[int], loop: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    raw = answer.encode()
    cut = raw[: min(keep, len(raw) - 1)]  # at least its last byte is missing

    async def one() -> None:
        try:
            got, _ = await _exchange(cut, cuts, close_after=True, requests=1)
        except UpstreamError:
            return
        # Only a body delimited by the connection's end can be whole without its last bytes.
        assert answer.framing == "close"
        assert answer.body.startswith(got[0][2])

    _run(loop, one())


URL_PIECE = st.sampled_from([
    "http", "https", "HTTP", "ftp", "", "://", ":/", ":", "//", "/", "?", "#", "@", "[", "]",
    "127.0.0.1", "[::1]", "example.com", "user@host", ":8000", ":0", ":99999", ":x", "a b",
    "nixl", "id-0", "=", "&", "%2F", "\t", "\r\n", "\x00", "\x7f", " ", "\u00e9",
])


@FUZZ
@given(st.lists(URL_PIECE, max_size=12), st.sampled_from([None, "pool.example"]))
def test_any_url_names_the_same_target_as_its_whole_parse(
    pieces: list[str], server_hostname: str | None
) -> None:
    url = "".join(pieces)
    try:
        expected = parse_url(url, server_hostname)
    except (UpstreamError, ValueError) as exc:
        with pytest.raises(type(exc)):
            target_of(url, server_hostname)
        return
    assert target_of(url, server_hostname) == expected


@FUZZ
@given(st.sampled_from(["http://127.0.0.1:8000", "https://[::1]", "http://h"]),
       st.lists(URL_PIECE, max_size=8))
def test_any_path_after_an_origin_names_the_same_target(origin: str, pieces: list[str]) -> None:
    url = origin + "/" + "".join(pieces)
    try:
        expected = parse_url(url, None)
    except (UpstreamError, ValueError) as exc:
        with pytest.raises(type(exc)):
            target_of(url, None)
        return
    assert target_of(url, None) == expected
