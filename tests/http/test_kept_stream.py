"""Proves the relay's keeping of a stream that may move (``relay.KeptStream``), read by read:
only whole events leave (an event cut across reads waits for its end, LF or CRLF), the
engine's own bytes are kept until the cap and then dropped for good, the ids the client did
not ask for are stripped from what leaves (never from what is kept), and an engine's 5xx
error event stops the stream before it leaves (the events before it do), while a 4xx one
leaves as written.

The whole path (relay, migration, client) is proven in tests/migration.
"""

from __future__ import annotations

from sidecar.dialects.continuation import completions_places
from sidecar.http_server.relay import KeptStream
from sidecar.protocol.continuation import ids_stripper

ASKED = b'data: {"choices":[{"text":"a","prompt_token_ids":null,"token_ids":[7]}]}\n\n'
UNASKED = b'data: {"choices":[{"text":"a","prompt_token_ids":null,"token_ids":null}]}\n\n'
FAILED = b'data: {"error": {"message": "x", "type": "InternalServerError", "code": 500}}\n\n'
REFUSED = b'data: {"error": {"message": "x", "type": "BadRequestError", "code": 400}}\n\n'
STRIP = ids_stripper(completions_places(unasked_null=True))


def test_only_whole_events_leave_and_the_engines_bytes_are_kept() -> None:
    kept = KeptStream(1 << 20, STRIP)
    assert kept.take(ASKED[:20]) == b""
    assert kept.take(ASKED[20:] + ASKED[:5]) == UNASKED
    assert kept.take(ASKED[5:]) == UNASKED
    assert bytes(kept.kept) == ASKED * 2 and kept.failure is None


def test_crlf_events_are_whole_too() -> None:
    crlf = ASKED.replace(b"\n\n", b"\n\r\n")
    kept = KeptStream(1 << 20)
    assert kept.take(crlf) == crlf


def test_past_the_cap_nothing_more_is_kept() -> None:
    kept = KeptStream(len(ASKED) * 2, STRIP)
    for _ in range(3):
        assert kept.take(ASKED) == UNASKED
    assert kept.overflowed and bytes(kept.kept) == b""


def test_an_engines_own_failure_stops_before_the_client() -> None:
    kept = KeptStream(1 << 20, STRIP)
    assert kept.take(ASKED + FAILED + b"data: [DONE]\n\n") == UNASKED
    assert kept.failure is not None and kept.failure.code == "decode_failed"


def test_a_4xx_error_event_leaves_as_written() -> None:
    kept = KeptStream(1 << 20, STRIP)
    assert kept.take(REFUSED) == REFUSED
    assert kept.failure is None
    assert kept.reported  # counted as the engine's error, as an unkept stream's is


def test_the_cap_bounds_what_many_small_reads_hold() -> None:
    # 2,000 events of 9 bytes are 18,000 bytes, under the cap; held one object per read,
    # they would take several times that: the cap counts what each kept read costs.
    tiny = b"data: 1\n\n"
    kept = KeptStream(32 * 1024)
    for _ in range(2_000):
        assert kept.take(tiny) == tiny
    assert kept.overflowed and kept.kept == b""


def test_what_is_kept_reads_back_as_the_engines_bytes() -> None:
    kept = KeptStream(1 << 20, STRIP)
    reads = [ASKED[:7], ASKED[7:] + ASKED, REFUSED]
    for read in reads:
        kept.take(read)
    assert kept.kept == b"".join(reads)
