"""gRPC's C core log (its own lines on stderr, e.g. every failed TLS handshake at INFO): kept
at the sidecar's level.

    quiet_grpc_core(argv, environ)   before grpc is imported: GRPC_VERBOSITY from --log-level

The C core writes to the process's stderr itself, past Python's logging, and reads
``GRPC_VERBOSITY`` once, when grpc is first imported; so the command line sets it before
anything imports grpc. The sidecar's ``info`` (its default) keeps the C core's errors only,
``debug`` lets its info lines through too, ``critical`` silences it. An operator's own
``GRPC_VERBOSITY`` is left as it is. Deliberate limit: the level is read from the flag and
``DISAGG_LOG_LEVEL`` only (no pod label sets it), without the settings' full load.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Final

#: The C core's verbosity for each of the sidecar's log levels.
GRPC_VERBOSITY: Final = {
    "debug": "INFO", "info": "ERROR", "warning": "ERROR", "error": "ERROR", "critical": "NONE",
}


def requested_log_level(argv: Sequence[str], environ: MutableMapping[str, str]) -> str:
    """The ``--log-level`` the command line or ``DISAGG_LOG_LEVEL`` names; ``info`` when
    neither does (the last flag wins, as argparse reads it)."""
    level = environ.get("DISAGG_LOG_LEVEL", "").strip() or "info"
    for index, arg in enumerate(argv):
        if arg == "--log-level" and index + 1 < len(argv):
            level = argv[index + 1]
        elif arg.startswith("--log-level="):
            level = arg.partition("=")[2]
    return level.strip().lower()


def quiet_grpc_core(argv: Sequence[str], environ: MutableMapping[str, str]) -> None:
    """Set ``GRPC_VERBOSITY`` for the requested log level, unless it is set already."""
    if environ.get("GRPC_VERBOSITY", "").strip():
        return
    environ["GRPC_VERBOSITY"] = GRPC_VERBOSITY.get(requested_log_level(argv, environ), "ERROR")
