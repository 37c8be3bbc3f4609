"""Engine-shaped answers every stub flavour gives, on either transport: the ``/v1/models``
body and Prometheus text lines.

    models_body("m", "vllm", root="m", ...) ─▶ {"object": "list", "data": [{"id": "m", ...}]}
    metric_lines([("gauge", "vllm:num_requests_running", 'model_name="m"', 0), ...])
        ─▶ ["# TYPE vllm:num_requests_running gauge", 'vllm:num_requests_running{...} 0']

Deliberate limits: only what the sidecar and the bench read (ids, counters, gauges); no
HELP lines except the hand-off metric's (``handoff.Tally``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

# (type, name, labels without braces or "", value)
Sample = tuple[str, str, str, float]


def models_body(model: str, owned_by: str, **extra: Any) -> dict[str, Any]:
    """One served model, with the engine's own extra keys after the common ones."""
    card = {"id": model, "object": "model", "created": int(time.time()), "owned_by": owned_by}
    return {"object": "list", "data": [{**card, **extra}]}


def metric_lines(samples: Iterable[Sample]) -> list[str]:
    lines: list[str] = []
    for kind, name, labels, value in samples:
        lines.append(f"# TYPE {name} {kind}")
        lines.append(f"{name}{{{labels}}} {value}" if labels else f"{name} {value}")
    return lines
