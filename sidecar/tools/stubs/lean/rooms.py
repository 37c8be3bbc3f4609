"""SGLang's bootstrap rendezvous for the lean engine: prefill and decode meet by room.

The same body (``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room``) goes to prefill
and decode at once; they meet on the prefill's bootstrap port, in either order:

    decode ── "WAIT <room> <timeout ms>\\n" ──▶ Board (prefill)     one channel per prefill,
    decode ◀─ "HAND <room> <digest> <n>\\n" ── Board                  shared by every room
              "TIMEOUT <room>\\n"  (no prefill of that room in time)   (as SGLang's ZMQ
              "FAIL <room> <why>\\n"                                    sockets are)
    decode ── "CANCEL <room>\\n" ─▶ Board         (the decode's client went away)

    prefill request (room R): Board.prefill(R, ...) hands over at once when a decode of R
    waits, else waits (bounded: ``bootstrap_timeout_s``) for one to arrive.

``RoomClient`` is the decode's end: ``await wait(host, port, room, timeout_s)`` returns the
prefill's ``(digest, prompt_tokens)`` or raises ``RoomTimeout`` / ``RoomFailed``. The
decode then compares the digest with its own prompt.

Deliberate limits: one bootstrap server per prefill engine, no data parallelism; a line
protocol of this bench, not SGLang's own wire format (the rendezvous semantics are SGLang's).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Final, cast

_MAX_LINE: Final = 1024


class RoomTimeout(Exception):
    pass


class RoomFailed(Exception):
    pass


@dataclass(slots=True)
class _Decode:
    channel: BoardChannel
    timer: asyncio.TimerHandle


@dataclass(slots=True)
class _Prefill:
    arrived: asyncio.Future[None]
    digest: int
    prompt_tokens: int


class Board:
    """The prefill's side: who waits in which room."""

    def __init__(self) -> None:
        self.decodes: dict[int, _Decode] = {}
        self.prefills: dict[int, _Prefill] = {}
        self.handed_over = 0

    def prefill(self, room: int, digest: int, prompt_tokens: int) -> asyncio.Future[None] | None:
        """None: handed over to a waiting decode. Else a future set when one arrives."""
        waiting = self.decodes.pop(room, None)
        if waiting is not None:
            waiting.timer.cancel()
            waiting.channel.hand(room, digest, prompt_tokens)
            self.handed_over += 1
            return None
        arrived: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.prefills[room] = _Prefill(arrived, digest, prompt_tokens)
        return arrived

    def forget_prefill(self, room: int, arrived: asyncio.Future[None]) -> None:
        entry = self.prefills.get(room)
        if entry is not None and entry.arrived is arrived:
            del self.prefills[room]

    def decode(self, channel: BoardChannel, room: int, timeout_s: float) -> None:
        waiting = self.prefills.pop(room, None)
        if waiting is not None and not waiting.arrived.done():
            channel.hand(room, waiting.digest, waiting.prompt_tokens)
            waiting.arrived.set_result(None)
            self.handed_over += 1
            return
        if room in self.decodes:
            channel.send(f"FAIL {room} room_in_use\n")
            return
        timer = asyncio.get_running_loop().call_later(timeout_s, self._expire, room)
        self.decodes[room] = _Decode(channel, timer)

    def _expire(self, room: int) -> None:
        waiting = self.decodes.pop(room, None)
        if waiting is not None:
            waiting.channel.send(f"TIMEOUT {room}\n")

    def cancel(self, channel: BoardChannel, room: int) -> None:
        waiting = self.decodes.get(room)
        if waiting is not None and waiting.channel is channel:
            waiting.timer.cancel()
            del self.decodes[room]

    def drop_channel(self, channel: BoardChannel) -> None:
        for room in [r for r, d in self.decodes.items() if d.channel is channel]:
            self.decodes.pop(room).timer.cancel()


class _Lines(asyncio.Protocol):
    """Newline-framed ASCII lines over a transport."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer + data
        *lines, self._buffer = buffer.split(b"\n")
        if len(self._buffer) > _MAX_LINE:
            self.bad_line(self._buffer)
            return
        for line in lines:
            self.line(line.decode("ascii", "replace").split())

    def send(self, text: str) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(text.encode())

    def line(self, words: list[str]) -> None:
        raise NotImplementedError

    def bad_line(self, line: bytes) -> None:
        if self.transport is not None:
            self.transport.close()


class BoardChannel(_Lines):
    """One decode engine's channel to the board."""

    def __init__(self, board: Board) -> None:
        super().__init__()
        self.board = board

    def hand(self, room: int, digest: int, prompt_tokens: int) -> None:
        self.send(f"HAND {room} {digest:016x} {prompt_tokens}\n")

    def line(self, words: list[str]) -> None:
        try:
            if words[0] == "WAIT" and len(words) == 3:
                self.board.decode(self, int(words[1]), int(words[2]) / 1000)
                return
            if words[0] == "CANCEL" and len(words) == 2:
                self.board.cancel(self, int(words[1]))
                return
        except (IndexError, ValueError):
            pass
        self.bad_line(" ".join(words).encode())

    def connection_lost(self, exc: Exception | None) -> None:
        self.board.drop_channel(self)


class _ClientChannel(_Lines):
    def __init__(self) -> None:
        super().__init__()
        self.waiting: dict[int, asyncio.Future[tuple[int, int]]] = {}
        self.closed = False

    def line(self, words: list[str]) -> None:
        try:
            room = int(words[1])
        except (IndexError, ValueError):
            self.bad_line(b" ".join(w.encode() for w in words))
            return
        future = self.waiting.pop(room, None)
        if future is None or future.done():
            return
        try:
            if words[0] == "HAND":
                future.set_result((int(words[2], 16), int(words[3])))
            elif words[0] == "TIMEOUT":
                future.set_exception(RoomTimeout(room))
            else:
                future.set_exception(RoomFailed(" ".join(words[2:]) or "refused"))
        except (IndexError, ValueError):
            future.set_exception(RoomFailed("malformed answer from the bootstrap server"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        for future in self.waiting.values():
            if not future.done():
                future.set_exception(RoomFailed("bootstrap channel lost"))
        self.waiting.clear()


class RoomClient:
    """The decode's end: one channel per prefill bootstrap address."""

    def __init__(self, connect_timeout_s: float = 5.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._channels: dict[tuple[str, int], asyncio.Future[_ClientChannel]] = {}

    async def _channel(self, host: str, port: int) -> _ClientChannel:
        key = (host, port)
        opening = self._channels.get(key)
        if opening is not None and opening.done() and (
            opening.cancelled() or opening.exception() is not None or opening.result().closed
        ):
            opening = None
        if opening is None:
            loop = asyncio.get_running_loop()
            opening = asyncio.ensure_future(self._open(loop, host, port))
            self._channels[key] = opening
        return await asyncio.shield(opening)

    async def _open(self, loop: asyncio.AbstractEventLoop, host: str, port: int) -> _ClientChannel:
        _, channel = await asyncio.wait_for(
            loop.create_connection(_ClientChannel, host, port), self.connect_timeout_s
        )
        return channel

    async def wait(self, host: str, port: int, room: int, timeout_s: float) -> tuple[int, int]:
        """The prefill's (digest, prompt token count) for ``room``."""
        try:
            channel = await self._channel(host, port)
        except (OSError, TimeoutError) as exc:
            raise RoomFailed(f"bootstrap server unreachable: {exc}") from None
        if room in channel.waiting:
            raise RoomFailed("room_in_use")
        future: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
        channel.waiting[room] = future
        channel.send(f"WAIT {room} {round(timeout_s * 1000)}\n")
        try:
            # The board answers TIMEOUT itself; this bound only covers a silent board.
            return await asyncio.wait_for(future, timeout_s + 1.0)
        except TimeoutError:
            raise RoomTimeout(room) from None
        except asyncio.CancelledError:
            channel.send(f"CANCEL {room}\n")
            raise
        finally:
            if channel.waiting.get(room) is future:
                del channel.waiting[room]

    def close(self) -> None:
        for opening in self._channels.values():
            if opening.done() and not opening.cancelled() and opening.exception() is None:
                transport = opening.result().transport
                if transport is not None:
                    transport.close()
            else:
                opening.cancel()
        self._channels.clear()

