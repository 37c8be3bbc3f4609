"""Proves ``sidecar.tasks.cancel_and_wait``, the one way the sidecar stops tasks it started:

- the tasks are cancelled and have ended when it returns; their errors, results and
  cancellations are retrieved, never raised;
- the caller's own cancellation is never swallowed: a caller cancelled while the tasks are
  still ending waits for them to end, then raises ``CancelledError``; an ``asyncio.timeout``
  around the caller fires (the helper this replaced returned normally in both cases);
- tasks already done are left as they are.

The waits are on events the tests set (no sleeps). Does not prove its users (their suites).
"""

from __future__ import annotations

import asyncio

import pytest

from sidecar.tasks import cancel_and_wait


class SlowToStop:
    """A task that, once cancelled, holds on until the test releases it."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancel_seen = asyncio.Event()
        self.release = asyncio.Event()
        self.ended = False
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        try:
            self.started.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancel_seen.set()
            await self.release.wait()
            raise
        finally:
            self.ended = True


async def test_tasks_end_and_their_outcomes_are_not_raised() -> None:
    async def fails() -> None:
        raise RuntimeError("its own error")

    slow = SlowToStop()
    failed = asyncio.ensure_future(fails())
    done = asyncio.ensure_future(asyncio.sleep(0, result=7))
    await asyncio.wait({failed, done})
    await slow.started.wait()
    slow.release.set()
    await cancel_and_wait(slow.task, failed, done)
    assert slow.ended and slow.task.cancelled()
    assert done.result() == 7


async def test_the_callers_cancellation_propagates_after_the_task_ended() -> None:
    slow = SlowToStop()
    await slow.started.wait()
    caller = asyncio.ensure_future(cancel_and_wait(slow.task))
    await slow.cancel_seen.wait()
    caller.cancel()
    await asyncio.sleep(0)  # the caller takes its cancellation while the task still runs
    assert not caller.done()  # it waits for the task to end first
    slow.release.set()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert slow.ended


async def test_a_timeout_around_the_caller_fires() -> None:
    slow = SlowToStop()
    await slow.started.wait()
    reached_after = False

    async def caller() -> None:
        nonlocal reached_after
        async with asyncio.timeout(0):  # expires at the first wait
            await cancel_and_wait(slow.task)
            reached_after = True

    running = asyncio.ensure_future(caller())
    await slow.cancel_seen.wait()
    slow.release.set()
    with pytest.raises(TimeoutError):
        await running
    assert not reached_after and slow.ended


async def test_done_tasks_are_left_alone() -> None:
    done = asyncio.ensure_future(asyncio.sleep(0, result="kept"))
    await done
    await cancel_and_wait(done)
    assert done.result() == "kept"
