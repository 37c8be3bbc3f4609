"""Ending tasks from the outside without losing the caller's own cancellation.

    await cancel_and_wait(task, ...)   cancel those still running, wait for all to end
    await wait_to_the_end(future)      work that cannot be stopped (a thread): wait for it
                                       even through the caller's cancellation, then raise that

Every place that stops work it started (a leg's task, a fan-out's readers, background
prefills, watchers at shutdown) goes through this one helper. The tasks' own outcomes
(result, error, cancellation) stay theirs: retrieved, never raised. The caller's
cancellation is never swallowed: if it comes while waiting, the wait still runs until the
tasks have ended (as an ``asyncio.TaskGroup`` waits for its children), so nothing they hold
is left running, and then ``CancelledError`` propagates (an ``asyncio.timeout`` around the
caller fires). ``contextlib.suppress(BaseException)`` around ``await task`` did neither: it
swallowed the caller's cancellation as well as the task's.

Deliberate limit: a task that ignores its cancellation holds its caller as long.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

T = TypeVar("T")


async def cancel_and_wait(*tasks: asyncio.Future[Any]) -> None:
    """Cancel each of ``tasks`` still running and return once all have ended; raises only the
    caller's own cancellation (after the tasks ended)."""
    running = {task for task in tasks if not task.done()}
    for task in running:
        task.cancel()
    cancelled: asyncio.CancelledError | None = None
    while running:
        try:
            _, running = await asyncio.wait(running)
        except asyncio.CancelledError as caller_cancelled:
            cancelled = caller_cancelled  # theirs is under way: wait for it, then ours
    for task in tasks:
        if not task.cancelled():
            task.exception()  # retrieved: a task error nobody awaits is not "never retrieved"
    if cancelled is not None:
        raise cancelled


async def wait_to_the_end(future: asyncio.Future[T]) -> T:
    """``future``'s result, waited for to its end even if the caller is cancelled meanwhile
    (work a cancellation cannot stop, such as a thread still writing files the caller removes
    next); then the caller's cancellation is raised, if it came."""
    cancelled: asyncio.CancelledError | None = None
    while not future.done():
        try:
            await asyncio.wait({future})
        except asyncio.CancelledError as caller_cancelled:
            cancelled = caller_cancelled
    if cancelled is not None:
        if not future.cancelled():
            future.exception()  # retrieved: the caller's cancellation is what is raised
        raise cancelled
    return future.result()
