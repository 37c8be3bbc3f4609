"""Proves a client that goes away during a migration cancels every engine call of it: the
engine that stalled (its connection closed when the stream moved away from it) and the
engine the stream moved to (its continuation, or the call reading the answer's ids back as
text while the move was still being prepared); nothing is left running, the in-flight gauge
returns to zero, and the request is counted as cancelled.

The decode stalls after three events (for good: its stall ends only by the test's release);
the sidecar's read deadline (``read_timeout_s``) turns the stall into the failure that moves
the stream. Each step the test waits on is a request the stubs record, never a timer.
"""

from __future__ import annotations

import asyncio

from migration_builders import metric_reaches, moving_pair, next_event, open_stream, route_body

from sidecar.protocol.context import Route
from sidecar.tools.stubs.faults import Fault, FaultKind

COMPLETIONS = Route.COMPLETIONS.value
CUT = 3


def stalled_decode() -> list[Fault]:
    return [Fault(kind=FaultKind.STALL, after_chunks=CUT, times=1, path=COMPLETIONS)]


async def test_a_client_gone_while_the_continuation_streams_cancels_both_engines() -> None:
    # The continuation writes a token every 0.2 s: still running when the client goes.
    async with moving_pair(decode_faults=stalled_decode(), read_timeout_s=1.0,
                           prefill={"itl_s": 0.2}) as pair:
        async with open_stream(pair, Route.COMPLETIONS,
                               route_body(Route.COMPLETIONS, max_tokens=50)) as response:
            for _ in range(CUT):
                await next_event(response)
            await pair.prefill.recorder.next_request(COMPLETIONS)  # the prefill leg
            continued = await pair.prefill.recorder.next_request(COMPLETIONS)
            assert isinstance(continued.json["prompt"], list)
            await next_event(response)  # the first continued token reached the client
            response.close()
        async with asyncio.timeout(10):
            await pair.decode.recorder.wait_idle()
            await pair.prefill.recorder.wait_idle()
        assert pair.decode.recorder.cancelled == 1  # the stalled stream, closed on the move
        assert pair.prefill.recorder.cancelled == 1  # the continuation
        await metric_reaches(pair.sidecar, "disagg_requests_total", 1, outcome="cancelled")
        await metric_reaches(pair.sidecar, "disagg_inflight_requests", 0)


async def test_a_client_gone_while_the_move_is_prepared_cancels_both_engines() -> None:
    # Reading the answer's ids back as text hangs on the target: the move is under way.
    hang = Fault(kind=FaultKind.HANG, path="/detokenize")
    async with moving_pair(decode_faults=stalled_decode(), prefill_faults=[hang],
                           read_timeout_s=1.0) as pair:
        async with open_stream(pair, Route.COMPLETIONS,
                               route_body(Route.COMPLETIONS, max_tokens=50)) as response:
            for _ in range(CUT):
                await next_event(response)
            await pair.prefill.recorder.next_request("/detokenize")
            response.close()
        async with asyncio.timeout(10):
            await pair.decode.recorder.wait_idle()
            await pair.prefill.recorder.wait_idle()
        assert pair.decode.recorder.cancelled == 1
        assert pair.prefill.recorder.cancelled >= 1  # the read-back calls in flight
        # No continuation was opened after the client went.
        assert [r.json for r in pair.prefill.recorder.on_path(COMPLETIONS)
                if isinstance(r.json.get("prompt"), list)] == []
        await metric_reaches(pair.sidecar, "disagg_requests_total", 1, outcome="cancelled")
        await metric_reaches(pair.sidecar, "disagg_inflight_requests", 0)
