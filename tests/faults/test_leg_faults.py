"""Proves how the HTTP front door answers an engine that misbehaves on either leg, for every
engine and connector: errors before the first byte (status, hang, reset, garbage, oversized
bodies) and after it (a stream that stalls, drops or is cut). Each scenario asserts the
client's status and error code, that no engine is left with a call in flight, that the
in-flight gauge is back to zero and that the sidecar still serves.

Concurrent pairs (SGLang, vLLM Mooncake) run the faults that strike before the engines
rendezvous, so the other leg is provably still waiting when the fault hits: the sidecar must
cancel it rather than leave it to the engine's bootstrap timeout.

Does not prove the real engines fail this way (the stubs imitate their wire behaviour), nor
cover the basic single-engine failures of tests/http/test_pd_failures.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from fault_builders import PAIRS, SEQUENTIAL, engine_param, faults, rig

from sidecar.protocol.context import Route

#: Short deadlines for the hang/stall rows only (a loaded CI machine must not turn the other
#: rows into deadline failures); the stubs answer in milliseconds.
SHORT = {"prefill_timeout_s": 1.0, "read_timeout_s": 1.0}


@dataclass(frozen=True)
class LegFault:
    """One row: a fault on one leg, and what the client must see."""

    name: str
    leg: str  # "prefill" | "decode"
    fault: dict[str, Any]
    stream: bool
    status: int
    code: str
    broken_stream: bool = False  # the error arrives as the last SSE event of a 200 stream
    settings: dict[str, Any] = field(default_factory=dict)


#: Faults that strike before any engine has done the hand-off: valid for every pair.
EARLY = [
    LegFault("prefill-500", "prefill", {"kind": "status", "status": 500}, True, 502,
             "prefill_failed"),
    LegFault("prefill-503-json", "prefill", {"kind": "status", "status": 503}, False, 502,
             "prefill_failed"),
    LegFault("prefill-429", "prefill", {"kind": "status", "status": 429}, True, 502,
             "prefill_failed"),
    LegFault("prefill-422", "prefill", {"kind": "status", "status": 422}, False, 400,
             "engine_rejected_request"),
    LegFault("prefill-hang", "prefill", {"kind": "hang"}, True, 504, "deadline_exceeded",
             settings=SHORT),
    LegFault("decode-500", "decode", {"kind": "status", "status": 500}, True, 502,
             "decode_failed"),
    LegFault("decode-400", "decode", {"kind": "status", "status": 400}, False, 400,
             "engine_rejected_request"),
    LegFault("decode-hang-before-head", "decode", {"kind": "hang"}, True, 504,
             "deadline_exceeded", settings=SHORT),
]

#: Faults that strike after the prefill computed its answer: sequential pairs only (on a
#: concurrent pair the decode may already have its KV, so the outcome would be a race).
LATE_PREFILL = [
    LegFault("prefill-truncated-json", "prefill", {"kind": "truncate"}, False, 502,
             "prefill_failed"),
    LegFault("prefill-malformed-json", "prefill", {"kind": "malformed"}, True, 502,
             "prefill_failed"),
    LegFault("prefill-reset", "prefill", {"kind": "drop"}, True, 502, "prefill_failed"),
    LegFault("prefill-stall-after-head", "prefill", {"kind": "stall"}, False, 504,
             "deadline_exceeded", settings=SHORT),
    LegFault("prefill-oversized", "prefill", {"kind": "oversized", "size": 256 * 1024}, False,
             502, "prefill_failed", settings={"max_prefill_response_bytes": 64 * 1024}),
]

#: Decode faults after its head arrived: the same for every pair (the hand-off is done).
LATE_DECODE = [
    LegFault("decode-reset-mid-stream", "decode", {"kind": "drop", "after_chunks": 2}, True,
             200, "decode_failed", broken_stream=True),
    LegFault("decode-stall-mid-stream", "decode", {"kind": "stall", "after_chunks": 2}, True,
             200, "deadline_exceeded", broken_stream=True, settings=SHORT),
    LegFault("decode-cut-stream", "decode", {"kind": "truncate", "after_chunks": 2}, True,
             200, "decode_failed", broken_stream=True),
    LegFault("decode-truncated-json", "decode", {"kind": "truncate"}, False, 502,
             "decode_failed"),
    LegFault("decode-malformed-json", "decode", {"kind": "malformed"}, False, 502,
             "decode_failed"),
    LegFault("decode-reset-json", "decode", {"kind": "drop"}, False, 502, "decode_failed"),
    LegFault("decode-stall-json", "decode", {"kind": "stall"}, False, 504,
             "deadline_exceeded", settings=SHORT),
    LegFault("decode-oversized-json", "decode", {"kind": "oversized", "size": 256 * 1024},
             False, 502, "decode_failed", settings={"max_body_bytes": 64 * 1024}),
]


def _cases() -> list[Any]:
    cases = []
    for engine, connector in PAIRS:
        rows = EARLY + LATE_DECODE
        if (engine, connector) in SEQUENTIAL:
            rows = rows + LATE_PREFILL
        for row in rows:
            cases.append(engine_param(engine, connector, row.name, row))
    return cases


@pytest.mark.parametrize(("engine", "connector", "name", "row"), _cases())
async def test_leg_fault(engine: str, connector: str, name: str, row: LegFault) -> None:
    settings = row.settings
    overrides = {"faults": faults({**row.fault, "times": 1})}
    async with rig(engine, connector, **{row.leg: overrides}, **settings) as r:
        body_route = Route.CHAT if name.endswith("json") else Route.COMPLETIONS
        reply = await r.post(body_route, stream=row.stream)
        if row.broken_stream:
            reply.expect_broken_stream(row.code)
        else:
            # An engine's 4xx reason is the client's own request's: relayed; 5xx never.
            engine_4xx = row.fault["kind"] == "status" and 400 <= row.fault["status"] < 500
            reply.expect_error(row.status, row.code, relayed=engine_4xx)
        await r.check_recovered()
