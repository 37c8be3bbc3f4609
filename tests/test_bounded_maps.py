"""Proves every map keyed by what routers or clients send is one ``BoundedMap`` with a
declared bound and eviction (issue 33, "one bounded map"):

- each module that makes a ``BoundedMap`` is a row of the one table in
  docs/operating/reliability-rules.md (its bound and eviction said there), and each row's
  module makes one;
- the maps that were cleared whole when full keep their newest keys instead: the selector's
  remembered selections (1,025 router headers left one), the data-parallel ranks' turns,
  the prefill URLs;
- the static pool's address labels, which grew with every address a pool name ever resolved
  to, keep the most recently resolved;
- the dead selection code is gone (``TargetSelector.choose``/``select``: tests only).

The breakers' and probes' bounds: tests/faults/test_breaker_probes.py; the identity cache's:
tests/dialects/test_vllm_nixl_push.py; the TTL cache's: tests/test_ttl_cache.py.
"""

from __future__ import annotations

import re
from pathlib import Path

from sidecar.engines.calls import _MAX_REMEMBERED_URLS, EngineCalls
from sidecar.http1 import EngineClient
from sidecar.protocol.context import PrefillTarget, Route
from sidecar.targets.allowlist import Allowlist
from sidecar.targets.choice import (
    _MAX_POOL_LABELS,
    _MAX_TURNS,
    HEADER_LABEL,
    RankChoice,
    TargetChoice,
)
from sidecar.targets.selector import _MAX_REMEMBERED, TargetSelector

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "operating" / "reliability-rules.md"
_MAKES = re.compile(r"BoundedMap\(|BoundedMap\[[^\]]*\]\(")


def _table_modules() -> set[str]:
    text = TABLE.read_text(encoding="utf-8")
    table = text.split("<!-- bounded-maps -->")[1].split("<!-- bounded-maps:end -->")[0]
    return set(re.findall(r"`(sidecar/[\w/]+\.py)`", table))


def test_every_bounded_map_is_a_row_of_the_table() -> None:
    makers = {
        str(path.relative_to(ROOT)) for path in (ROOT / "sidecar").rglob("*.py")
        if path.name != "bounded.py" and _MAKES.search(path.read_text(encoding="utf-8"))
    }
    assert makers, "no BoundedMap found: the scan is broken"
    assert makers == _table_modules()


def _target(n: int) -> PrefillTarget:
    return PrefillTarget(f"10.{n >> 16}.{(n >> 8) & 255}.{n & 255}", 8000)


async def test_the_remembered_selections_keep_the_newest() -> None:
    selector = TargetSelector(Allowlist.parse(["10.0.0.0/8:*"]), [], resolve_timeout_s=1.0)
    for n in range(_MAX_REMEMBERED + 1):
        await selector.candidates([f"{_target(n).host}:8000"])
    remembered = selector._literal_selections
    assert len(remembered) == _MAX_REMEMBERED
    assert (f"{_target(1).host}:8000",) in remembered  # cleared whole, it held one
    assert (f"{_target(0).host}:8000",) not in remembered  # the oldest went


def test_the_rank_turns_keep_the_newest() -> None:
    ranks = RankChoice(cooldown_s=0.0)
    for n in range(_MAX_TURNS):
        assert ranks.pick_rank(_target(n), 4) == 0
    ranks.pick_rank(_target(_MAX_TURNS), 4)  # one more engine
    assert ranks.pick_rank(_target(_MAX_TURNS - 1), 4) == 1  # its turn moved on, kept
    assert ranks.pick_rank(_target(0), 4) == 0  # the oldest was forgotten: from 0 again


async def test_the_prefill_urls_keep_the_newest() -> None:
    session = EngineClient(limit=1, keepalive_s=1, connect_timeout_s=1, read_timeout_s=1)
    try:
        calls = EngineCalls(session, "http://127.0.0.1:1", connect_timeout_s=1,
                            max_prefill_response_bytes=1024)
        for n in range(_MAX_REMEMBERED_URLS + 1):
            calls.prefill_url(_target(n), Route.COMPLETIONS)
        urls = calls._prefill_urls
        assert len(urls) == _MAX_REMEMBERED_URLS
        assert (_target(1), Route.COMPLETIONS) in urls
    finally:
        await session.close()


def test_the_dead_selection_code_is_gone() -> None:
    assert not hasattr(TargetSelector, "choose") and not hasattr(TargetSelector, "select")


def test_the_pool_labels_keep_the_most_recently_resolved() -> None:
    configured = _target(0)
    choice = TargetChoice(cooldown_s=0.0, pool=[configured])
    for n in range(1, _MAX_POOL_LABELS):
        choice.add_pool_member(_target(n))
    choice.add_pool_member(configured)  # resolved again: the most recent, not the oldest
    choice.add_pool_member(_target(_MAX_POOL_LABELS))  # one address past the bound
    assert len(choice._pool_labels) == _MAX_POOL_LABELS
    assert choice.label(configured) == str(configured)
    assert choice.label(_target(1)) == HEADER_LABEL  # resolved longest ago: forgotten
    assert choice.label(_target(2)) == str(_target(2))
    assert choice.label(_target(_MAX_POOL_LABELS)) == str(_target(_MAX_POOL_LABELS))
