"""The event loop every command of the sidecar runs on: uvloop where installed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any


def run_async(main: Coroutine[Any, Any, int]) -> int:
    """Run ``main`` on uvloop where installed, else the default loop."""
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        pass
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
