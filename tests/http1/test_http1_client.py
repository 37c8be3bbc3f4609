"""The upstream HTTP/1.1 client against scripted servers on loopback.

Proves: requests are framed exactly (request line, Host, headers, Content-Length or chunked);
responses with Content-Length, chunked and close-delimited bodies are read whole; keep-alive
connections are reused and dropped when the answer was not clean; every failure is typed
(refused, reset mid-body, malformed, read deadline, header injection); close() reaches the
server; the connection limit makes callers wait instead of opening more; a slow reader
pauses the socket instead of buffering the whole answer; ``pipe()`` hands each read to its
sink, keeps a cleanly ended connection, stops reading while the sink is full until its
catch-up ran, and reports a cut or silent engine as ``readany()`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from sidecar.http1 import (
    EngineClient,
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK_JSON = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


@contextlib.asynccontextmanager
async def scripted(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A loopback server running ``handler`` per connection; yields (base URL, peer ports)."""
    peers: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer.get_extra_info("peername")[1])
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", peers
    finally:
        server.close()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request's head and Content-Length body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length)


def client(**overrides: float) -> EngineClient:
    options: dict[str, float] = {"limit": 8, "keepalive_s": 30.0, "connect_timeout_s": 5.0,
                                 "read_timeout_s": 30.0}
    options.update(overrides)
    return EngineClient(limit=int(options["limit"]), keepalive_s=options["keepalive_s"],
                        connect_timeout_s=options["connect_timeout_s"],
                        read_timeout_s=options["read_timeout_s"])


async def test_post_is_framed_exactly_and_the_connection_is_reused() -> None:
    heads: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            head, body = await read_request(reader)
            heads.append(head + body)
            writer.write(OK_JSON)

    async with scripted(serve) as (url, peers):
        http = client()
        for _ in range(2):
            response = await http.request("POST", url + "/v1/completions?x=1",
                                          headers={"X-Request-Id": "r1"}, body=b'{"a":1}')
            assert response.status == 200
            assert response.header("content-type") == "application/json"
            assert response.content_length == 2
            assert await response.read() == b"{}"
            response.release()
        await http.close()
    host = url.removeprefix("http://")
    assert heads[0] == (
        f"POST /v1/completions?x=1 HTTP/1.1\r\nHost: {host}\r\nX-Request-Id: r1\r\n"
        "Content-Length: 7\r\n\r\n{\"a\":1}"
    ).encode()
    assert len(peers) == 1  # the second request rode the first one's connection


async def test_chunked_and_close_delimited_bodies_are_read_whole() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"5\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n0\r\n\r\n")
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
        await writer.drain()

    async with scripted(serve) as (url, _):
        http = client()
        response = await http.request("GET", url + "/a")
        assert await response.read() == b"hello world"
        response.release()
        response = await http.request("GET", url + "/b")
        assert await response.read() == b"until the end"
        response.release()
        await http.close()


async def test_refused_connection_is_a_connect_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, never listening: connections are refused
        http = client()
        with pytest.raises(UpstreamConnectError):
            await http.request("GET", f"http://127.0.0.1:{port}/health")
        assert http.open_connections == 0
        await http.close()


async def test_reset_mid_body_is_broken_and_the_connection_not_reused() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()

    async with scripted(serve) as (url, _):
        http = client()
        response = await http.request("GET", url + "/x")
        with pytest.raises(UpstreamBroken):
            await response.read()
        response.release()
        assert http.open_connections == 0
        await http.close()


async def test_garbage_is_a_protocol_error() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with scripted(serve) as (url, _):
        http = client()
        with pytest.raises(UpstreamProtocolError):
            await http.request("GET", url + "/x")
        await http.close()


async def test_silent_engine_hits_the_read_deadline() -> None:
    gone = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()  # returns when the client drops the connection
        gone.set()

    async with scripted(serve) as (url, _):
        http = client(read_timeout_s=0.05)
        with pytest.raises(TimeoutError):
            await http.request("GET", url + "/x")
        await gone.wait()  # the timed-out exchange's connection was closed
        assert http.open_connections == 0
        await http.close()


async def test_header_injection_is_refused_before_sending() -> None:
    http = client()
    for headers in ({"X-A": "v\r\nX-Evil: 1"}, {"X-A\nB": "v"}, {"X-A": "v\0"}):
        with pytest.raises(UpstreamError):
            await http.request("GET", "http://127.0.0.1:9/x", headers=headers)
    assert http.open_connections == 0
    await http.close()


async def test_close_mid_answer_reaches_the_engine() -> None:
    gone = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await reader.read()
        gone.set()

    async with scripted(serve) as (url, _):
        http = client()
        response = await http.request("POST", url + "/v1/completions", body=b"{}")
        assert await response.readany() == b"hello"
        response.close()
        await gone.wait()
        await http.close()


async def test_connection_limit_makes_callers_wait() -> None:
    release = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            await release.wait()
            writer.write(OK_JSON)

    async with scripted(serve) as (url, peers):
        http = client(limit=1)
        holder = asyncio.ensure_future(http.request("GET", url + "/a"))
        await asyncio.sleep(0)  # one loop turn: the first caller takes the only slot
        waiting = asyncio.ensure_future(http.request("GET", url + "/b"))
        await asyncio.sleep(0)  # one loop turn: the second caller queues for it
        assert not waiting.done() and http.open_connections == 1
        release.set()
        response = await holder
        assert await response.read() == b"{}"
        response.release()
        second = await waiting
        assert await second.read() == b"{}"
        second.release()
        assert len(peers) == 1
        await http.close()


async def test_idle_connections_older_than_the_keepalive_are_not_reused() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                await read_request(reader)
                writer.write(OK_JSON)

    async with scripted(serve) as (url, peers):
        http = client(keepalive_s=0.0)  # every idle connection is already too old
        for _ in range(2):
            response = await http.request("GET", url + "/a")
            await response.read()
            response.release()
        assert len(peers) == 2
        await http.close()


async def test_slow_reader_pauses_the_socket() -> None:
    big = b"x" * (4 * 1024 * 1024)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big) + big)
        await writer.drain()

    async with scripted(serve) as (url, _):
        http = client()
        response = await http.request("GET", url + "/big")
        total = 0
        largest = 0
        while chunk := await response.readany():
            total += len(chunk)
            largest = max(largest, len(chunk))
        assert total == len(big)
        # Never much more than the high-water mark is queued between two reads.
        assert largest < 2 * 1024 * 1024
        response.release()
        await http.close()


async def test_streamed_request_bodies_chunked_and_with_length() -> None:
    bodies: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        assert b"Transfer-Encoding: chunked" in head
        bodies.append(await reader.readuntil(b"0\r\n\r\n"))
        writer.write(OK_JSON)
        head, body = await read_request(reader)
        bodies.append(body)
        writer.write(OK_JSON)

    async def parts() -> AsyncIterator[bytes]:
        yield b"ab"
        yield b""
        yield b"cde"

    async with scripted(serve) as (url, _):
        http = client()
        response = await http.request("POST", url + "/a", body=parts())
        await response.read()
        response.release()
        response = await http.request("POST", url + "/b", body=parts(), content_length=5)
        await response.read()
        response.release()
        await http.close()
    assert bodies == [b"2\r\nab\r\n3\r\ncde\r\n0\r\n\r\n", b"abcde"]


async def test_bytes_after_an_answer_keep_the_answer_but_drop_the_connection() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                await read_request(reader)
                writer.write(OK_JSON + b"unsolicited")

    async with scripted(serve) as (url, peers):
        http = client()
        for _ in range(2):
            response = await http.request("GET", url + "/a")
            assert await response.read() == b"{}"
            response.release()
        assert len(peers) == 2
        await http.close()


async def test_informational_answers_are_refused() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + OK_JSON)
        await writer.drain()
        await reader.read()

    async with scripted(serve) as (url, _):
        http = client()
        with pytest.raises(UpstreamProtocolError):
            await http.request("GET", url + "/x")
        await http.close()


async def test_the_exchange_deadline_bounds_the_body_and_the_slot_wait() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")
        await writer.drain()
        await reader.read()

    async with scripted(serve) as (url, _):
        http = client(limit=1)
        response = await http.request("GET", url + "/a", timeout_s=0.05)
        with pytest.raises(TimeoutError):
            await response.read()  # the head came in time, the rest never does
        # The first exchange still holds the only slot: the second times out waiting for it.
        with pytest.raises(TimeoutError):
            await http.request("GET", url + "/b", timeout_s=0.05)
        response.close()
        await http.close()


async def test_close_from_another_task_fails_a_waiting_reader_at_once() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with scripted(serve) as (url, _):
        http = client()  # read deadline 30 s: only close() can end the wait quickly
        response = await http.request("POST", url + "/v1/completions", body=b"{}")
        reading = asyncio.ensure_future(response.readany())
        await asyncio.sleep(0)  # one loop turn: the reader is waiting for bytes
        assert not reading.done()
        response.close()
        with pytest.raises(UpstreamBroken):
            await reading
        assert await response.readany() == b""  # the handle is spent, not reusable
        await http.close()


async def test_idle_connections_are_closed_after_the_keepalive() -> None:
    closed = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK_JSON)
        await reader.read()  # returns when the client closes the idle connection
        closed.set()

    async with scripted(serve) as (url, _):
        http = client(keepalive_s=0.05)
        response = await http.request("GET", url + "/a")
        await response.read()
        response.release()
        await closed.wait()  # the sweep closed it, no request needed
        await asyncio.sleep(0)
        assert http.open_connections == 0
        await http.close()


async def test_a_waiter_cancelled_after_its_wake_up_passes_the_slot_on() -> None:
    release = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                await read_request(reader)
                await release.wait()
                writer.write(OK_JSON)

    async with scripted(serve) as (url, _):
        http = client(limit=1)
        holder = asyncio.ensure_future(http.request("GET", url + "/a"))
        await asyncio.sleep(0)  # one loop turn: the holder takes the only slot
        first = asyncio.ensure_future(http.request("GET", url + "/b"))
        second = asyncio.ensure_future(http.request("GET", url + "/c"))
        await asyncio.sleep(0)  # one loop turn: both queue for the slot, first in front
        release.set()
        response = await holder
        await response.read()
        response.release()  # wakes `first` ...
        first.cancel()  # ... which is cancelled before it could run
        with pytest.raises(asyncio.CancelledError):
            await first
        async with asyncio.timeout(5):  # a guard: without the hand-over this waits for ever
            answer = await second
        assert await answer.read() == b"{}"
        answer.release()
        await http.close()


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


async def test_pipe_hands_each_read_to_the_sink_and_keeps_the_connection() -> None:
    got_first = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            await read_request(reader)
            got_first.clear()
            writer.write(CHUNKED_HEAD + b"5\r\nhello\r\n")
            await writer.drain()
            await got_first.wait()  # the second piece leaves only after the first arrived
            writer.write(b"6\r\n world\r\n0\r\n\r\n")
            await writer.drain()

    async def no_catch_up() -> None:
        raise AssertionError("a sink that takes everything never needs catching up")

    async with scripted(serve) as (url, peers):
        http = client()
        for _ in range(2):
            pieces: list[bytes] = []

            def sink(data: bytes, pieces: list[bytes] = pieces) -> bool:
                pieces.append(data)
                got_first.set()
                return True

            response = await http.request("GET", url + "/stream")
            await response.pipe(sink, no_catch_up)
            assert b"".join(pieces) == b"hello world"
            assert len(pieces) == 2  # one call per read, the second after the first
        assert len(peers) == 1  # the piped answer ended cleanly: the connection was reused
        await http.close()


async def test_a_full_sink_pauses_reading_until_it_caught_up() -> None:
    got = {name: asyncio.Event() for name in "ab"}
    third_sent = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD + b"1\r\na\r\n")
        await writer.drain()
        await got["a"].wait()
        writer.write(b"1\r\nb\r\n")
        await writer.drain()
        await got["b"].wait()
        writer.write(b"1\r\nc\r\n0\r\n\r\n")
        await writer.drain()
        third_sent.set()

    log: list[str] = []
    async with scripted(serve) as (url, _):
        http = client()
        response = await http.request("GET", url + "/stream")
        transport = response._conn.transport  # type: ignore[union-attr]
        assert transport is not None

        def sink(data: bytes) -> bool:
            name = data.decode()
            log.append(f"sink {name}")
            if name in got:
                got[name].set()
            return name != "b"  # full after the second piece

        async def catch_up() -> None:
            log.append("catch_up")
            assert not transport.is_reading()  # paused while the sink is full
            await third_sent.wait()
            await asyncio.sleep(0)  # a loop turn in which a read would have run
            log.append("caught up")

        await response.pipe(sink, catch_up)
        assert log == ["sink a", "sink b", "catch_up", "caught up", "sink c"]
        await http.close()


async def test_pipe_reports_a_break_and_a_silent_engine() -> None:
    gone = asyncio.Event()

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD + b"5\r\nhel")
        await writer.drain()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD + b"5\r\nhello\r\n")
        await writer.drain()
        await reader.read()  # returns when the client drops the connection
        gone.set()

    async def no_catch_up() -> None:
        raise AssertionError("not reached")

    async with scripted(cut) as (url, _):
        http = client()
        response = await http.request("GET", url + "/stream")
        with pytest.raises(UpstreamBroken):
            await response.pipe(lambda data: True, no_catch_up)
        response.release()
        assert http.open_connections == 0
        await http.close()
    async with scripted(silent) as (url, _):
        http = client(read_timeout_s=0.05)
        response = await http.request("GET", url + "/stream")
        with pytest.raises(TimeoutError):
            await response.pipe(lambda data: True, no_catch_up)
        response.close()
        await gone.wait()  # the timed-out exchange's connection was closed
        await http.close()


async def test_a_sink_that_raises_is_reported_as_itself_not_as_the_engine(
        caplog: pytest.LogCaptureFixture) -> None:
    """A sink failing in the read callback (a stream rewrite) escaped ``data_received``: an
    asyncio "fatal error", then "engine closed the connection mid-response"."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD + b"5\r\nhello\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)  # the second read arrives while the sink is set
        writer.write(b"6\r\n world\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()

    class RewriteFailed(Exception):
        pass

    def sink(data: bytes) -> bool:
        if data.endswith(b"world"):
            raise RewriteFailed("the usage rewrite broke")
        return True

    async def no_catch_up() -> None:
        raise AssertionError("not reached")

    async with scripted(serve) as (url, _):
        response = await client().request("GET", url + "/stream")
        with pytest.raises(RewriteFailed, match="usage rewrite"):
            await response.pipe(sink, no_catch_up)
    assert not [r for r in caplog.records if "Fatal error" in r.getMessage()]


async def test_peek_leaves_the_first_bytes_for_the_next_read() -> None:
    release = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n6\r\ndata: \r\n")
        await writer.drain()
        await release.wait()
        writer.write(b"3\r\n1\n\n\r\n0\r\n\r\n")
        await writer.drain()

    async with scripted(serve) as (url, _):
        http = client()
        response = await http.request("GET", url + "/s")
        assert await response.peek() == b"data: "
        assert await response.peek() == b"data: "  # still there
        release.set()
        assert await response.read() == b"data: 1\n\n"
        assert await response.peek() == b""  # ended
        response.release()
        await http.close()
