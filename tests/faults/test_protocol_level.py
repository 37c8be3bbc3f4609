"""The protocol-level suite: what a hostile client sends, and what the engines then receive.

Each class of attack is sent over a raw socket (so nothing on the client side tidies it up)
and judged by what the stub engines recorded (``sidecar.tools.stubs.recorder``), not only by
the status the client got:

- smuggling by encoding: a gzip body whose inflated bytes hold a second request reaches the
  engine as one request with its true length and no ``Content-Encoding`` (passthrough and PD
  legs); a coding the sidecar does not decode is refused (415) on every path, engine untouched;
- hop-by-hop by name: headers a ``Connection`` header names are not forwarded (RFC 9110
  7.6.1), either way;
- number fidelity: integers beyond 64 bits reach the engines exactly as sent, or nowhere;
- id patterns: an id ending in a line feed is refused, never forwarded;
- aiohttp's own rejections (malformed framing, bare CR/LF, obs-fold, oversized headers,
  CONNECT, ``OPTIONS *``): OpenAI-shaped JSON or a closed connection, no client bytes
  echoed, one rate-limited log line and no traceback.

The stub engines do not inflate bodies (as uvicorn does not), so they record the bytes on
the wire. Does not prove what a real engine's parser makes of the same bytes (the stubs run
aiohttp's).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import zlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fault_builders import Rig, client_body, eventually, rig

from sidecar.protocol.context import Route

COMPLETIONS = Route.COMPLETIONS.value
SMUGGLED_PROMPT = "smuggled past the sidecar"


# -- raw HTTP/1.1 --------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def raw_connection(r: Rig) -> AsyncIterator[tuple[asyncio.StreamReader,
                                                         asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", r.sidecar.ports["http"])
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response off the socket: status, headers (lower-case names), body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 10)
    elif headers.get("transfer-encoding") == "chunked":
        body = b""
        while size := int((await asyncio.wait_for(reader.readline(), 10)).strip(), 16):
            body += await reader.readexactly(size)
            await reader.readexactly(2)
        await reader.readexactly(2)
    else:
        body = await asyncio.wait_for(reader.read(), 10)
    return status, headers, body


async def send_raw(r: Rig, data: bytes) -> tuple[int, dict[str, str], bytes]:
    async with raw_connection(r) as (reader, writer):
        writer.write(data)
        await writer.drain()
        return await read_response(reader)


def post_head(path: str, length: int, *, target: str | None, extra: str = "") -> bytes:
    routing = f"x-prefiller-host-port: {target}\r\n" if target else ""
    return (f"POST {path} HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n"
            f"{routing}Content-Length: {length}\r\n{extra}\r\n").encode()


async def gauge_is(r: Rig, value: float) -> bool:
    return await r.inflight() == value


def error_code(body: bytes) -> str:
    payload = json.loads(body)
    assert set(payload) == {"error"}, payload
    return str(payload["error"]["code"])


# -- smuggling by encoding -----------------------------------------------------------------

def smuggling_gzip() -> tuple[bytes, bytes]:
    """A gzip body whose inflated form is the compressed length of padding, then a whole
    second request: an engine told the compressed length reads that request as its next."""
    inner = json.dumps({"model": "stub-model", "prompt": SMUGGLED_PROMPT,
                        "max_tokens": 1}).encode()
    smuggled = (b"POST /v1/completions HTTP/1.1\r\nHost: evil.example\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(inner)
                + inner)
    for pad in range(1, 4096):
        first = b'{"pad": "' + b"a" * pad + b'"}'
        packed = gzip.compress(first + smuggled, mtime=0)
        if len(packed) == len(first):
            return packed, first + smuggled
    raise AssertionError("no padding makes the compressed and first lengths meet")


def smuggled_anywhere(r: Rig) -> list[Any]:
    return [entry for stub in (r.prefill, r.decode) for entry in stub.recorder.requests
            if SMUGGLED_PROMPT.encode() in entry.body and entry.headers.get("Host") ==
            "evil.example"]


async def test_a_gzip_body_inflating_past_its_length_smuggles_nothing_through_passthrough(
) -> None:
    packed, inflated = smuggling_gzip()
    assert len(inflated) > len(packed)
    async with rig() as r:
        status, _, _ = await send_raw(r, post_head(
            COMPLETIONS, len(packed), target=None, extra="Content-Encoding: gzip\r\n") + packed)
        got = await r.decode.recorder.next_request(COMPLETIONS)
        await r.wait_upstreams_closed()
        assert smuggled_anywhere(r) == []
        assert len(r.decode.recorder.on_path(COMPLETIONS)) == 1
        assert got.body == inflated  # the bytes the sidecar read, all of them, once
        assert got.headers["Content-Length"] == str(len(inflated))
        assert "Content-Encoding" not in got.headers
        assert status == 400  # the engine's own verdict on a body that is not a request
        await r.check_recovered()


async def test_a_body_shorter_once_inflated_is_sent_with_its_own_length() -> None:
    body = json.dumps(client_body()).encode()
    packed = gzip.compress(body + b" " * 4096, mtime=0)  # inflates to far more
    deflated = zlib.compress(body)
    assert len(deflated) < len(body)
    async with rig(read_timeout_s=5.0) as r:
        for coding, data, sent in (("gzip", packed, body + b" " * 4096),
                                   ("deflate", deflated, body)):
            status, _, _ = await send_raw(r, post_head(
                COMPLETIONS, len(data), target=None,
                extra=f"Content-Encoding: {coding}\r\n") + data)
            assert status == 200
            got = await r.decode.recorder.next_request(COMPLETIONS)
            assert got.body == sent and got.headers["Content-Length"] == str(len(sent))
            assert "Content-Encoding" not in got.headers
        await r.check_recovered()


@pytest.mark.parametrize("stream", [False, True])
async def test_pd_legs_never_carry_the_clients_content_encoding(stream: bool) -> None:
    body = json.dumps(client_body(stream=stream)).encode()
    packed = gzip.compress(body, mtime=0)
    async with rig() as r:
        status, _, reply = await send_raw(r, post_head(
            COMPLETIONS, len(packed), target=r.target,
            extra="Content-Encoding: gzip\r\n") + packed)
        assert status == 200, reply[:300]
        for stub in (r.prefill, r.decode):
            got = await stub.recorder.next_request(COMPLETIONS)
            assert "Content-Encoding" not in got.headers
            assert got.json["prompt"] == client_body()["prompt"]
            assert got.headers["Content-Length"] == str(len(got.body))
        await r.check_recovered()


@pytest.mark.parametrize("coding", ["compress", "gzip, gzip", "x-gzip", "bogus"])
@pytest.mark.parametrize("pd", [False, True], ids=["passthrough", "pd"])
async def test_a_coding_the_sidecar_does_not_decode_is_415_and_reaches_no_engine(
        coding: str, pd: bool) -> None:
    body = json.dumps(client_body()).encode()
    async with rig() as r:
        target = r.target if pd else None
        for path in (COMPLETIONS, "/v1/models-unknown"):
            status, _, reply = await send_raw(r, post_head(
                path, len(body), target=target,
                extra=f"Content-Encoding: {coding}\r\n") + body)
            assert (status, error_code(reply)) == (415, "unsupported_content_encoding")
        # Two headers, each a coding aiohttp decodes alone.
        status, _, reply = await send_raw(r, post_head(
            COMPLETIONS, len(body), target=target,
            extra="Content-Encoding: identity\r\nContent-Encoding: gzip\r\n") + body)
        assert status in (400, 415), reply
        assert r.prefill.recorder.on_path(COMPLETIONS) == []
        assert r.decode.recorder.on_path(COMPLETIONS) == []
        await r.check_recovered()


# -- compressed bodies: what they cost the sidecar ---------------------------------------

def bomb(inflated_bytes: int) -> bytes:
    """A gzip body of a few KB that inflates to ``inflated_bytes`` of one JSON string."""
    head, tail = b'{"model": "m", "prompt": "', b'", "max_tokens": 1}'
    filler = b"x" * (inflated_bytes - len(head) - len(tail))
    return gzip.compress(head + filler + tail, mtime=0)


@pytest.mark.parametrize("pd", [False, True], ids=["passthrough", "pd"])
async def test_a_compressed_body_past_its_inflation_ratio_is_413_before_it_ends(
        pd: bool) -> None:
    # 31 KB that inflates to just under the 32 MiB body cap, then the client stalls: the
    # sidecar refuses as soon as the ratio is passed, without waiting for the rest (the body
    # deadline is far away) and without holding what it inflated.
    packed = bomb(32 * 1024 * 1024 - 4096)
    assert len(packed) < 40 * 1024
    async with rig(client_body_timeout_s=600.0) as r:
        target = r.target if pd else None
        async with raw_connection(r) as (reader, writer):
            writer.write(post_head(COMPLETIONS, len(packed) + 100, target=target,
                                   extra="Content-Encoding: gzip\r\n") + packed)
            await writer.drain()
            status, _, reply = await read_response(reader)
        assert (status, error_code(reply)) == (413, "body_too_large")
        assert b"--max-body-inflation" in reply
        assert r.decode.recorder.on_path(COMPLETIONS) == []
        assert r.prefill.recorder.on_path(COMPLETIONS) == []
        await r.check_recovered()


async def test_compressed_bodies_being_read_share_one_budget() -> None:
    # Each body inflates within its ratio (past the floor, 20 x what it sent), but together
    # they may hold no more than the budget: the second one that would pass it is refused
    # (503, the sidecar's memory is spoken for), while the first keeps its share.
    plain = json.dumps({**client_body(), "prompt": "y" * (1536 * 1024)}).encode()
    packed = zlib.compress(plain, 1)
    ratio = len(plain) / len(packed)
    async with rig(client_body_timeout_s=600.0, max_inflating_body_bytes=2 * 1024 * 1024,
                   max_body_inflation=ratio * 2) as r:
        async with raw_connection(r) as (reader, writer), \
                raw_connection(r) as (reader2, writer2):
            # The first body, all but its last bytes: its inflated share stays held.
            writer.write(post_head(COMPLETIONS, len(packed), target=None,
                                   extra="Content-Encoding: deflate\r\n") + packed[:-16])
            await writer.drain()
            async def first_holds_its_share() -> bool:
                return await r.inflating() > 1024 * 1024

            await eventually(first_holds_its_share)
            writer2.write(post_head(COMPLETIONS, len(packed), target=None,
                                    extra="Content-Encoding: deflate\r\n") + packed)
            await writer2.drain()
            status, _, reply = await read_response(reader2)
            assert (status, error_code(reply)) == (503, "overloaded")
            assert b"--max-inflating-body-bytes" in reply
            writer.write(packed[-16:])  # the first body ends: it is forwarded whole
            await writer.drain()
            status, _, reply = await read_response(reader)
            # Whatever the engine made of so long a prompt, it was the engine's to say.
            assert status in (200, 400), reply
        (got,) = r.decode.recorder.on_path(COMPLETIONS)
        assert got.body == plain and "Content-Encoding" not in got.headers
        assert await r.inflating() == 0


# -- hop-by-hop by name --------------------------------------------------------------------

@pytest.mark.parametrize("pd", [False, True], ids=["passthrough", "pd"])
async def test_headers_named_in_connection_are_not_forwarded(pd: bool) -> None:
    body = json.dumps(client_body()).encode()
    async with rig() as r:
        status, _, reply = await send_raw(r, post_head(
            COMPLETIONS, len(body), target=r.target if pd else None,
            extra="Connection: keep-alive, X-Hop-Secret,x-other-hop\r\n"
                  "X-Hop-Secret: for the sidecar only\r\nX-Other-Hop: 1\r\n"
                  "X-End-To-End: kept\r\n") + body)
        assert status == 200, reply[:300]
        stubs = (r.prefill, r.decode) if pd else (r.decode,)
        for stub in stubs:
            got = await stub.recorder.next_request(COMPLETIONS)
            assert "X-Hop-Secret" not in got.headers and "X-Other-Hop" not in got.headers
            assert got.headers["X-End-To-End"] == "kept"
        await r.check_recovered()


def test_engine_response_headers_named_in_connection_are_not_relayed() -> None:
    from sidecar.http_server.app import response_headers

    relayed = response_headers([("Connection", "x-engine-hop"), ("X-Engine-Hop", "1"),
                                ("Content-Type", "application/json"), ("X-Kept", "2")])
    assert dict(relayed) == {"Content-Type": "application/json", "X-Kept": "2"}


# -- number fidelity -----------------------------------------------------------------------

@pytest.mark.parametrize(("field", "value", "where"), [
    ("seed", 2**64, "seed"),
    ("seed", -(2**63) - 1, "seed"),
    ("logit_bias", {"50256": 10**30}, "logit_bias.50256"),
    ("stop_token_ids", [1, 2, 2**70], "stop_token_ids[2]"),
])
@pytest.mark.parametrize("stream", [False, True])
async def test_an_integer_beyond_64_bits_is_refused_naming_its_field(
        field: str, value: Any, where: str, stream: bool) -> None:
    body = json.dumps(client_body(stream=stream, **{field: value})).encode()
    async with rig() as r:
        status, _, reply = await send_raw(r, post_head(COMPLETIONS, len(body),
                                                       target=r.target) + body)
        assert (status, error_code(reply)) == (400, "invalid_request")
        assert f"field {where}:" in json.loads(reply)["error"]["message"]
        assert r.prefill.recorder.on_path(COMPLETIONS) == []
        assert r.decode.recorder.on_path(COMPLETIONS) == []
        await r.check_recovered()


async def test_integers_at_the_64_bit_edges_reach_both_engines_exactly() -> None:
    extremes = {"seed": 2**64 - 1, "user": "12345678901234567890123 in a string",
                "logit_bias": {"7": -(2**63)}}
    body = json.dumps(client_body(**extremes)).encode()
    async with rig() as r:
        status, _, reply = await send_raw(r, post_head(COMPLETIONS, len(body),
                                                       target=r.target) + body)
        assert status == 200, reply[:300]
        for stub in (r.prefill, r.decode):
            got = await stub.recorder.next_request(COMPLETIONS)
            assert b'"seed":18446744073709551615' in got.body  # the digits, not a float
            assert b'"7":-9223372036854775808' in got.body
            assert got.json["user"] == extremes["user"]
        await r.check_recovered()


async def test_passthrough_forwards_any_number_as_its_bytes() -> None:
    body = b'{"model": "stub-model", "prompt": "x", "seed": 18446744073709551616}'
    async with rig() as r:
        await send_raw(r, post_head(COMPLETIONS, len(body), target=None) + body)
        got = await r.decode.recorder.next_request(COMPLETIONS)
        assert got.body == body


def test_a_grpc_handoff_with_an_integer_beyond_64_bits_is_invalid() -> None:
    from sidecar import jsonutil
    from sidecar.errors import InvalidRequest
    from sidecar.grpc_gen import disagg_pb2
    from sidecar.grpc_server.layers import HANDOFF_LAYER
    from sidecar.grpc_server.native import decode_handoff

    document = b'{"version": 1, "kind": "x", "fields": {"id": 18446744073709551616}}'
    block = disagg_pb2.KVBlock(request_id="r", layer_idx=HANDOFF_LAYER, block_idx=0,
                               k_data=document)
    with pytest.raises(InvalidRequest, match=r"fields\.id: integer outside the 64-bit range"):
        decode_handoff([block])
    with pytest.raises(jsonutil.IntegerOutOfRange):
        jsonutil.loads_exact(document)


# -- aiohttp's own rejections --------------------------------------------------------------

SECRET = "client-bytes-never-echoed"
REJECTED: dict[str, bytes] = {
    "content-length-and-chunked": (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\nX-S: " + SECRET.encode() + b"\r\n\r\n0\r\n\r\n"),
    "bare-lf": b"GET /v1/models HTTP/1.1\nHost: x\nX-S: " + SECRET.encode() + b"\n\n",
    "bare-cr": b"GET /v1/models HTTP/1.1\rX-S: " + SECRET.encode() + b"\r\n\r\n",
    "obs-fold": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: a\r\n " + SECRET.encode()
                + b"\r\n\r\n",
    "header-over-8k": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + SECRET.encode()
                      + b"a" * 9000 + b"\r\n\r\n",
    "bad-method": b"G(T /" + SECRET.encode() + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "tls-on-http": b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + SECRET.encode()
                   + b"\r\n\r\n",
    "bad-chunk-size": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                       b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n"
                       + SECRET.encode() + b"\r\n"),
    "connect": b"CONNECT " + SECRET.encode() + b".example:443 HTTP/1.1\r\nHost: x\r\n\r\n",
    "options-asterisk": b"OPTIONS * HTTP/1.1\r\nHost: " + SECRET.encode() + b"\r\n\r\n",
}


async def answer_or_close(r: Rig, data: bytes) -> tuple[int, dict[str, str], bytes] | None:
    """The sidecar's answer to ``data``, or None when it closed the connection unanswered."""
    async with raw_connection(r) as (reader, writer):
        writer.write(data)
        await writer.drain()
        try:
            return await read_response(reader)
        except asyncio.IncompleteReadError as cut:
            assert cut.partial == b"", cut.partial
            return None


async def test_aiohttps_own_rejections_answer_json_without_the_clients_bytes(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with rig() as r:
        for name, data in REJECTED.items():
            answer = await answer_or_close(r, data)
            if answer is None:
                continue  # an unusable connection, closed: also allowed
            status, headers, body = answer
            assert status == 400, (name, status, body)
            assert headers["content-type"].startswith("application/json"), name
            assert error_code(body) == "invalid_request", name
            assert SECRET.encode() not in body, name
        for _ in range(8):  # a flood: one more line at most, within the interval
            await answer_or_close(r, REJECTED["bare-lf"])
        assert r.prefill.recorder.requests == r.prefill.recorder.requests.__class__()
        assert not r.decode.recorder.on_path(COMPLETIONS)
        await r.check_recovered()
    refusals = [rec for rec in caplog.records if rec.name.endswith("aiohttp_private")
                and rec.levelno >= logging.WARNING]
    assert len(refusals) == 1, [rec.getMessage() for rec in refusals]
    for record in caplog.records:
        assert SECRET not in record.getMessage(), record.getMessage()
        if record.levelno >= logging.WARNING:
            assert record.exc_info is None, record.getMessage()
        assert record.levelno < logging.ERROR, record.getMessage()


async def test_a_body_whose_coding_breaks_is_400_and_nothing_reaches_an_engine(
        caplog: pytest.LogCaptureFixture) -> None:
    async with rig() as r:
        for target in (r.target, None):
            status, _, body = await send_raw(r, post_head(
                COMPLETIONS, 16, target=target, extra="Content-Encoding: gzip\r\n")
                + SECRET.encode()[:16])
            assert (status, error_code(body)) == (400, "invalid_request")
            assert SECRET.encode()[:16] not in body
        # A chunked passthrough body that breaks after its first chunk reached the engine.
        async with raw_connection(r) as (reader, writer):
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n")
            await writer.drain()
            await eventually(lambda: gauge_is(r, 1))  # admitted, its body on the way
            writer.write(b"zz\r\n" + SECRET.encode() + b"\r\n")
            await writer.drain()
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                status, _, body = await read_response(reader)
                assert (status, error_code(body)) == (400, "invalid_request")
        assert not r.decode.recorder.on_path(COMPLETIONS)
        assert not r.prefill.recorder.on_path(COMPLETIONS)
        await r.check_recovered()
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
