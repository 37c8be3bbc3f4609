"""Proves the layer-notice channel between SidecarKVConnector and the prefill sidecar.

The connector's sender (``send_notice``) reaches a ``LayerNotices`` listener on both event
loops the sidecar runs on (asyncio, uvloop); malformed datagrams and notices for another key
are ignored; ``highest`` only grows; ``wait()`` returns after a notice or ``wake()``; the
socket file is removed on exit; without a listener, or with a path too long for
``sun_path``, sending is a harmless False and the listener runs without notices; a socket
that is already there (another sidecar's) is left alone. Does not prove the streaming built
on it (test_prefill_streaming.py).
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvloop

from connectors.inline_layout import (
    encode_notice,
    notice_path,
    notice_sender,
    parse_notice,
    send_notice,
)
from sidecar.grpc_server.inline.layer_watch import LayerNotices


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvn-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_notice_wire_format() -> None:
    assert encode_notice("p-1", 12) == b"p-1 12"
    assert parse_notice(b"p-1 12") == ("p-1", 12)
    for bad in (b"p-1", b"p-1 -1", b"p-1 +1", b"p-1  1", b"../x 1", b"p-1 1 2", b"\xff 1",
                b"p-1 x", b"p" * 200 + b" 1"):
        assert parse_notice(bad) is None, bad
    assert notice_path(Path("/s"), "p-1") == Path("/s/.p-1.notify")


async def _round_trip(root: Path) -> None:
    sender = notice_sender()
    with LayerNotices(root, "p-1") as notices:
        assert notices.listening and notices.path.is_socket()
        assert notices.highest == -1
        target = str(notices.path)
        for junk in (b"garbage", b"p-2 5", b"p-1 -3"):
            sender.sendto(junk, target)
        assert send_notice(sender, root, "p-1", 1)
        await notices.wait()
        assert notices.highest == 1
        assert send_notice(sender, root, "p-1", 0)  # an older layer never lowers it
        await notices.wait()
        assert notices.highest == 1
        notices.wake()
        await notices.wait()
    assert not notices.path.exists() and not notices.listening
    assert not send_notice(sender, root, "p-1", 2)  # nobody listens: dropped, no error
    sender.close()


async def test_notices_reach_the_listener(root: Path) -> None:
    await _round_trip(root)


def test_notices_reach_the_listener_on_uvloop(root: Path) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_round_trip(root))


async def test_too_long_a_path_runs_without_notices(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    deep = root / ("d" * 100)
    deep.mkdir()
    with LayerNotices(deep, "p-1") as notices:
        assert not notices.listening
        assert not send_notice(notice_sender(), deep, "p-1", 0)
        notices.wake()
        await notices.wait()
    assert "no layer notices" in caplog.text
    assert list(deep.iterdir()) == []


async def test_someone_elses_socket_is_left_alone(root: Path) -> None:
    other = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    other.bind(str(notice_path(root, "p-1")))
    try:
        with LayerNotices(root, "p-1") as notices:
            assert not notices.listening
        assert notice_path(root, "p-1").is_socket()
    finally:
        other.close()
