"""The deadlines of one pooled connection's exchange, and the waits they bound.

    read deadline   ``read_timeout_s`` after the connection's last received bytes (as
                    aiohttp's ``sock_read`` counts it)
    whole exchange  ``deadline`` (loop time), from the request's start, body included

Both are served by one timer per connection, re-armed lazily: a relayed stream waits once per
chunk, and a timer created and cancelled per wait would cost more than the wait itself. A
wait past its deadline fails with the builtin ``TimeoutError``.

``Deadlines`` is a base of ``connection.Connection`` rather than an object it holds: the read
path stamps ``_last_io`` on every read (once per token of a relayed stream), and on the same
object that stays one attribute store.
"""

from __future__ import annotations

import asyncio


class Deadlines:
    """The deadline state and the bounded waits of one connection."""

    __slots__ = ("_deadline", "_last_io", "_loop", "_read_timeout_s", "_timed", "_timer")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._read_timeout_s: float | None = None
        self._deadline: float | None = None
        self._last_io = 0.0  # loop time of the last received bytes (or of the request)
        self._timed: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def set_deadlines(self, read_timeout_s: float | None, deadline: float | None) -> None:
        """A new exchange starts now, bounded per read and (``deadline``) as a whole."""
        self._read_timeout_s = read_timeout_s
        self._deadline = deadline
        self._last_io = self._loop.time()

    async def _wait_for(self, future: asyncio.Future[None]) -> None:
        """Await ``future``, failing it with ``TimeoutError`` at the read or total deadline.

        The read deadline counts from the connection's last received bytes (as aiohttp's
        ``sock_read`` does), the total one from the request's start.
        """
        when = self._expiry()
        if when is None:
            await future
            return
        self._timed = future
        if self._timer is None:
            self._timer = self._loop.call_at(when, self._on_timer)
        try:
            await future
        finally:
            self._timed = None

    def _expiry(self) -> float | None:
        when = None if self._read_timeout_s is None else self._last_io + self._read_timeout_s
        if self._deadline is not None and (when is None or self._deadline < when):
            when = self._deadline
        return when

    def _on_timer(self) -> None:
        self._timer = None
        future = self._timed
        if future is None or future.done():
            return  # nobody waits now; the next wait arms a new timer
        when = self._expiry()
        if when is None:
            return
        if when <= self._loop.time():
            expire_future(future)
        else:
            self._timer = self._loop.call_at(when, self._on_timer)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def expire_future(future: asyncio.Future[None]) -> None:
    """A timer's callback: end a wait with ``TimeoutError`` unless it already ended."""
    if not future.done():
        future.set_exception(TimeoutError())
