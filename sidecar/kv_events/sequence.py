"""The batches' sequence numbers: in order, missed, or a new publisher.

    first batch (any number) ─▶ IN_ORDER    n == expected ─▶ IN_ORDER
    n > expected ─▶ MISSED (expected .. n-1 never arrived)
    n < expected ─▶ RESTARTED (a new publisher counts from 0 again)
    after a lost connection: n == expected ─▶ LEFTOVER (still queued from the dead one)
                             any other n   ─▶ IN_ORDER, as a first batch

A publisher numbers its batches 0, 1, 2, ... and the first ones are often lost (a ZMQ PUB drops
what it sends before the connection is up), so the first batch seen may have any number.

Deliberate limits: after a lost connection a batch continuing the old numbering is taken for a
leftover of the dead connection; a publisher that reconnects and continues its numbering
without a gap is heard again from its next gap (until then the index answers unknown).
"""

from __future__ import annotations

from enum import Enum


class Verdict(Enum):
    IN_ORDER = "in_order"
    MISSED = "missed"
    RESTARTED = "restarted"
    LEFTOVER = "leftover"


class SequenceCheck:
    """The next expected number, and whether the connection was lost since."""

    def __init__(self) -> None:
        #: The number the next batch should have; None before the first one.
        self.expected: int | None = None
        self._disconnected = False

    def check(self, sequence: int) -> Verdict:
        """The verdict on a batch numbered ``sequence`` (``accept`` it to move on)."""
        expected = self.expected
        if self._disconnected:
            if sequence == expected:
                return Verdict.LEFTOVER
            return Verdict.IN_ORDER
        if expected is None or sequence == expected:
            return Verdict.IN_ORDER
        return Verdict.MISSED if sequence > expected else Verdict.RESTARTED

    def accept(self, sequence: int) -> None:
        """``sequence`` was applied (or skipped as a leftover): expect the next."""
        if self._disconnected and sequence != self.expected:
            self._disconnected = False
        self.expected = sequence + 1

    def disconnected(self) -> None:
        """The publisher's connection closed: batches continuing its numbering are leftovers."""
        if self.expected is not None:
            self._disconnected = True
