"""Did every PD request run one prefill leg and one decode leg with a good hand-off?

    before = await read(prefill_url, decode_url, stubs="lean")
    ... calls through a ``flows.Counted`` flow ...
    check = verdict(before, await read(...), calls)   # {"calls", "prefill_legs", ..., "ok"}

The stubs count what they served (``GET /metrics``): ``stub_requests_total`` (the lean
transport: completions served) and the decode's ``stub_handoff_total{outcome}`` (``remote``:
the decode used the prefill's KV). Over a window in which ``calls`` PD requests were sent
one way (direct, the sidecar, an anchor router), a good flow leaves exactly ``calls``
completions on each stub and ``calls`` remote verdicts, nothing else. A router that sent a
leg twice, skipped the prefill, or broke the hand-off cannot pass as a fast one.

Deliberate limits: the aiohttp stub transport counts every request it serves (health checks,
metrics reads) in ``stub_requests_total``, so with ``--stubs aiohttp`` only the verdicts are
checked (``prefill_legs``/``decode_legs`` are None).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass(frozen=True)
class StubCounts:
    """What the two stubs had served at one moment."""

    prefill: int | None  # completions served (None: not counted by this transport)
    decode: int | None
    verdicts: dict[str, int] = field(default_factory=dict)  # decode's hand-off outcomes


def parse_metrics(text: str) -> tuple[int | None, dict[str, int]]:
    """``stub_requests_total`` and ``stub_handoff_total`` by outcome from a stub's metrics."""
    requests: int | None = None
    verdicts: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("stub_requests_total "):
            requests = int(float(line.rsplit(" ", 1)[1]))
        elif line.startswith("stub_handoff_total{"):
            labels, value = line.rsplit(" ", 1)
            outcome = labels.split('outcome="', 1)[1].split('"', 1)[0]
            verdicts[outcome] = verdicts.get(outcome, 0) + int(float(value))
    return requests, verdicts


async def read(prefill_url: str, decode_url: str, stubs: str = "lean") -> StubCounts:
    async with aiohttp.ClientSession(trust_env=False) as session:
        texts = []
        for url in (prefill_url, decode_url):
            async with session.get(url + "/metrics") as response:
                texts.append(await response.text())
    prefill, _ = parse_metrics(texts[0])
    decode, verdicts = parse_metrics(texts[1])
    if stubs != "lean":
        prefill = decode = None
    return StubCounts(prefill, decode, verdicts)


def verdict(before: StubCounts, after: StubCounts, calls: int) -> dict[str, Any]:
    """The window's legs and verdicts against the ``calls`` PD requests sent in it."""
    outcomes = {
        outcome: after.verdicts.get(outcome, 0) - before.verdicts.get(outcome, 0)
        for outcome in after.verdicts.keys() | before.verdicts.keys()
    }
    outcomes = {k: v for k, v in sorted(outcomes.items()) if v}
    prefill = _delta(before.prefill, after.prefill)
    decode = _delta(before.decode, after.decode)
    ok = (outcomes == ({"remote": calls} if calls else {})
          and prefill in (None, calls) and decode in (None, calls))
    return {"calls": calls, "prefill_legs": prefill, "decode_legs": decode,
            "verdicts": outcomes, "ok": ok}


def _delta(before: int | None, after: int | None) -> int | None:
    if before is None or after is None:
        return None
    return after - before


def brief(check: dict[str, Any]) -> str:
    """One line for the log and the table: ``ok`` or what differed."""
    if check["ok"]:
        return "ok"
    return (f"MISMATCH: {check['calls']} calls, prefill legs {check['prefill_legs']}, "
            f"decode legs {check['decode_legs']}, verdicts {check['verdicts']}")
