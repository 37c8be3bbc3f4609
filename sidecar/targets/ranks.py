"""The router's data-parallel rank: strict parsing of the ``x-data-parallel-rank`` header.

    header "3" ─parse_rank_header(values, size)─▶ 3   (the prefill leg's rank)
    no header  ─────────────────────────────────▶ None (the sidecar chooses: TargetChoice)

A router that placed the request on a prefill engine's rank names it here (vLLM's own header
name, which vllm-project/router and llm-d send); the sidecar puts it where the prefill
engine reads it and never forwards the header itself. Like every routing header it is
parsed strictly: one value, ASCII decimal digits only (no sign, space or leading zero), and
below the prefill engines' data-parallel size; anything else is refused (400).

Deliberate limits: the header names the prefill leg's rank only; the decode leg's rank is
this sidecar's own choice on its local engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from sidecar.errors import InvalidRequest

RANK_HEADER: Final = "x-data-parallel-rank"
#: Longer than any rank below the size bound (1024): refused before it is read as a number.
_MAX_DIGITS: Final = 4


def parse_rank(text: str, size: int, *, name: str = RANK_HEADER) -> int:
    """One rank written as ``text``, checked against ``size`` ranks."""
    if not (0 < len(text) <= _MAX_DIGITS and text.isascii() and text.isdigit()):
        raise InvalidRequest(f"{name}: expected a rank in 0..{size - 1}")
    if len(text) > 1 and text[0] == "0":
        raise InvalidRequest(f"{name}: a rank has no leading zero")
    rank = int(text)
    if rank >= size:
        raise InvalidRequest(
            f"{name}: rank {rank} is out of range; the prefill engines have {size} "
            f"data-parallel rank{'s' if size != 1 else ''} (0..{size - 1})"
        )
    return rank


def parse_rank_header(values: Sequence[str], size: int) -> int | None:
    """The rank a request's ``x-data-parallel-rank`` header names, or None without one.

    Engines with one rank (``size`` 1): the header may name only 0, and names nothing (no
    leg ever carries a rank then).
    """
    if not values:
        return None
    if len(values) > 1:
        raise InvalidRequest(f"{RANK_HEADER}: given more than once")
    rank = parse_rank(values[0], size)
    return rank if size > 1 else None
