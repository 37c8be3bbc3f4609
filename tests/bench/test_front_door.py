"""``bench.front_door``'s two doors: the figure compares like with like only if both answer
the same request with the same bytes.

Proves: the sidecar's aiohttp door and the llhttp door each answer the bench's request with
status 200 and ``ANSWER``'s bytes over one kept-alive connection, with the same header names
(no ``Server`` header on either), and the llhttp door refuses a body over its cap with 413 and
another path with 404. Does not prove the instruction counts: no valgrind runs here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Set

import pytest

from bench import front_door


async def head_names(port: int, body: bytes = front_door.REQUEST,
                     path: str = front_door.PATH) -> tuple[int, Set[str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body))
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        names = {line.split(":", 1)[0].lower() for line in lines[1:] if line}
        length = next(int(line.split(":", 1)[1]) for line in lines[1:]
                      if line.lower().startswith("content-length:"))
        return int(lines[0].split()[1]), names, await reader.readexactly(length)
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def both() -> AsyncIterator[tuple[int, int]]:
    async with front_door.aiohttp_door() as aiohttp_port, \
            front_door.llhttp_door() as llhttp_port:
        yield aiohttp_port, llhttp_port


async def test_both_doors_answer_the_same_bytes() -> None:
    async with both() as (aiohttp_port, llhttp_port):
        answers = [await head_names(port) for port in (aiohttp_port, llhttp_port)]
        for port in (aiohttp_port, llhttp_port):
            await front_door.send(port, 3)  # one kept-alive connection, each answer checked
    assert answers[0] == answers[1]
    status, names, body = answers[0]
    assert status == 200 and body == front_door.ANSWER
    assert names == {"content-type", "x-request-id", "content-length", "date"}


@pytest.mark.parametrize(("body", "path", "status"), [
    (b"x" * (front_door.MAX_BODY + 1), front_door.PATH, 413),
    (front_door.REQUEST, "/v1/other", 404),
])
async def test_the_llhttp_door_refuses_what_it_does_not_serve(body: bytes, path: str,
                                                              status: int) -> None:
    async with front_door.llhttp_door() as port:
        answered, _, _ = await head_names(port, body, path)
    assert answered == status
