"""Environment variables that look like settings and are not: the warning that names them.

    unknown_variable_warnings(environ, "DISAGG_", known)  ->  one warning per stray variable

A misspelt variable (``DISAGG_ENGNE=vllm``) would otherwise be ignored without a word and the
setting it meant left at its default; the warning names the closest setting's variable. A
variable in the wrong case (``disagg_engine``) is named with its upper-case spelling, since
variable names are case-sensitive and only the upper-case one is read.

Deliberate limits: every variable with the prefix that sets nothing is named, including the
project's test harnesses' own (``DISAGG_VLLM_ENV``, ...) when a developer's shell holds them:
the warning is true there too, and costs one line at start.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

#: Where every setting's variable is listed, for a stray variable close to none.
REFERENCE = "docs/operating/configuration.md"


def unknown_variable_warnings(environ: Mapping[str, str], prefix: str,
                              known: Iterable[str]) -> list[str]:
    """A warning for each variable of ``environ`` whose name starts with ``prefix`` in any
    case and is none of ``known``, sorted by name."""
    names = sorted(known)
    warnings = []
    for variable in sorted(environ):
        upper = variable.upper()
        if not upper.startswith(prefix) or variable in names:
            continue
        if upper in names:
            why = f"names are upper case: {upper}"
        else:
            close = difflib.get_close_matches(upper, names, n=1, cutoff=0.6)
            why = f"did you mean {close[0]}?" if close else f"every setting's variable: {REFERENCE}"
        warnings.append(f"environment variable {variable} is not a setting and is ignored ({why})")
    return warnings
