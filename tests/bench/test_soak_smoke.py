"""``python -m bench.soak`` end to end for a few seconds: stubs, sidecar and load start, every
request (chat and completions, streamed and JSON) succeeds, and the report is written.

The soak is run by hand for minutes; this keeps it runnable (it once broke silently when the
bench's default stubs changed to ones that serve completions only).
"""

from __future__ import annotations

import json
from pathlib import Path

from bench import soak


def test_a_short_soak_has_no_errors(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    assert soak.main(["--minutes", "0.05", "--concurrency", "4", "--sample-s", "1",
                      "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["errors"] == 0
    assert report["requests"] > 0
