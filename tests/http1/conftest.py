"""Every test of the upstream client and of the lean server runs on both loops the sidecar
uses: asyncio's own (the tests' default) and uvloop (what ``disagg-sidecar serve`` and the
lean stubs run on), whose transports differ in buffering, flow control and close ordering."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest
import uvloop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
