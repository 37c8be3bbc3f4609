"""The work one relayed read costs the sidecar: what every token of a stream at an engine's pace
pays, counted where no machine's load moves it.

    python -m bench.relay_read                    bytecodes per read, each case (a table)
    python -m bench.relay_read --json             the same as JSON
    python -m bench.relay_read --instructions     also user-space instructions per read, under
                                                  valgrind's callgrind (a minute; needs valgrind)

At an engine's pace each token is its own read (``bench.paced``), and each read runs the
relay's ``SSERelay.feed`` in the upstream connection's read callback: the bytes written to the
client's socket (``aiohttp_private.ClientSocket``), the stream's bookkeeping, and for a stream
that may move (``KeptStream``) the whole-event check, the kept read and the strip of the ids
the client did not ask for. A case feeds one stream's reads, one vLLM completions event each
(the lean stub's chunk: 270 bytes, the first with the prompt's ids when asked), to the real
relay; the client's socket is a stand-in whose methods are C built-ins, so only the sidecar's
code counts:

    bare        a stream that cannot move (``--migration-limit 0``, or a body migration
                refuses): the engine's bytes as they come
    kept        the default: the engine was asked for its ids; the client gets them stripped
    kept-chat   the same on chat completions (vLLM's: one more check per read, for the chunk
                written only when ids are asked)

Bytecodes (``sys.settrace`` opcode events) are counted for one read in the middle of the
stream: the figure the budget test holds (tests/bench/test_request_budget.py). What runs in C
is not in them: the ids' regular expression, a bytes search, an exception a call raises and
clears inside (``bytes.__contains__`` did, once per read); ``--instructions`` counts that
too, as the difference of two runs of ``STREAMS`` streams, one whose streams end before their
first read and one whose streams have all their ``READS`` reads, divided by the reads: start-up
and each stream's own set-up cancel out.

Deliberate limits: the upstream connection's side of a read (llhttp's parse, ``data_received``,
about a third of a read's bytecodes) and the kernel's are not in these figures (the whole
request's are: ``bench.bytecodes``, ``bench.instructions``); one event per read, as at an
engine's pace.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sidecar.dialects.vllm import TOKEN_ID_PLACES
from sidecar.http_server.aiohttp_private import ClientSocket
from sidecar.http_server.relay import KeptStream, SSERelay
from sidecar.protocol.context import Route
from sidecar.protocol.continuation import TokenIdPlaces, ids_stripper
from sidecar.protocol.sse import OPENAI_STREAM

CASES = ("bare", "kept", "kept-chat")
#: Reads per stream (the paced benchmark's 64 tokens).
READS = 64
#: Which read is counted in bytecodes (not the first: it alone carries the prompt's ids).
COUNTED = READS // 2
#: The streams of each ``--instructions`` run.
STREAMS = 100
#: The relay's cap on a kept stream (the default ``--migration-max-stream-bytes``).
KEPT_CAP = 8 * 1024 * 1024

_COMPLETION = (b'data: {"id":"cmpl-0f1e2d3c4b5a69788796a5b4c3d2e1f0","object":"text_completion",'
               b'"created":1765000000,"model":"stub-model","choices":[{"index":0,"text":" w%d",'
               b'"logprobs":null,"finish_reason":null,"stop_reason":null,'
               b'"prompt_token_ids":%s,"token_ids":%s}],"usage":null}\n\n')
_CHAT = (b'data: {"id":"chatcmpl-0f1e2d3c4b5a69788796a5b4c3d2e1f0",'
         b'"object":"chat.completion.chunk","created":1765000000,"model":"stub-model","choices":[{"index":0,"delta":'
         b'{"content":" w%d"},"logprobs":null,"finish_reason":null,"token_ids":%s}],'
         b'"prompt_token_ids":%s}\n\n')
_PROMPT_IDS = b"[464,2068,7586,21831,18045,625,262,16931,3290,11,290,262,3290,44747,319,13]"


def _events(case: str) -> list[bytes]:
    """One stream's reads as the engine writes them for ``case`` (asked for ids or not)."""
    asked = case != "bare"
    out = []
    for i in range(READS):
        prompt = _PROMPT_IDS if asked and i == 0 else b"null"
        ids = b"[%d]" % (1000 + i) if asked else b"null"
        if case == "kept-chat":
            out.append(_CHAT % (i, ids, prompt))
        else:
            out.append(_COMPLETION % (i, prompt, ids))
    return out


def _strip(case: str) -> Callable[[bytes], bytes] | None:
    """The case's strip of the ids the client did not ask for (one per route and process, as
    a request's migration plan has it); None: the stream is not kept."""
    if case == "bare":
        return None
    places: TokenIdPlaces = TOKEN_ID_PLACES[Route.CHAT if case == "kept-chat"
                                            else Route.COMPLETIONS]
    return ids_stripper(places)


class _Transport:
    """The client's transport, its methods C built-ins (no bytecode of the stand-in counts)."""

    def __init__(self) -> None:
        self.written: collections.deque[bytes] = collections.deque(maxlen=1)
        self.write = self.written.append
        self.is_closing = bool  # bool() is False: the client is there
        self.get_write_buffer_size = int  # int() is 0: the socket takes everything


def _relay(strip: Callable[[bytes], bytes] | None) -> SSERelay:
    """A relay whose response head has left (its first chunk went through aiohttp)."""
    transport = _Transport()
    request: Any = types.SimpleNamespace(protocol=types.SimpleNamespace(transport=transport),
                                         writer=None)
    kept = KeptStream(KEPT_CAP, strip) if strip is not None else None
    relay = SSERelay(request, {"Content-Type": "text/event-stream"}, OPENAI_STREAM, kept=kept)
    relay.response.headers["Transfer-Encoding"] = "chunked"  # as prepare() sets it
    # What start() and the first chunk's catch_up() leave (they need a live aiohttp request).
    relay._socket = ClientSocket(request, relay.response)
    relay._started = True
    return relay


def bytecodes(case: str) -> int:
    """Bytecodes the ``COUNTED``-th read of ``case``'s stream runs in the relay."""
    events = _events(case)
    relay = _relay(_strip(case))
    feed: Callable[[bytes], bool] = relay.feed
    for event in events[:COUNTED]:
        feed(event)
    count = 0

    def on_opcode(frame: types.FrameType, event: str, arg: object) -> Any:
        nonlocal count
        if event == "opcode":
            count += 1
        return on_opcode

    def on_call(frame: types.FrameType, event: str, arg: object) -> Any:
        frame.f_trace_opcodes = True
        return on_opcode

    sys.settrace(on_call)
    try:
        feed(events[COUNTED])
    finally:
        sys.settrace(None)
    return count


def _feed_streams(case: str, reads: int) -> None:
    """``STREAMS`` streams of ``case``, ``reads`` reads each, through fresh relays (one
    ``--instructions`` run)."""
    events = _events(case)[:reads]
    strip = _strip(case)
    for _ in range(STREAMS):
        feed = _relay(strip).feed
        for event in events:
            feed(event)


def _callgrind_total(case: str, reads: int, workdir: Path) -> int:
    out = workdir / f"callgrind-{case}-{reads}.out"
    subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
         "-m", "bench.relay_read", "--feed", case, "--reads", str(reads)],
        check=True, capture_output=True)
    for line in out.read_text(errors="replace").splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError(f"no summary line in {out}")


def instructions(case: str) -> float:
    """User-space instructions per read of ``case`` (callgrind, two runs' difference)."""
    with tempfile.TemporaryDirectory(prefix="bench-relay-read-") as tmp:
        unread = _callgrind_total(case, 0, Path(tmp))
        read = _callgrind_total(case, READS, Path(tmp))
    return (read - unread) / (STREAMS * READS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.relay_read",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--instructions", action="store_true",
                        help="also callgrind's user-space instructions per read")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--feed", choices=CASES, help=argparse.SUPPRESS)  # a callgrind run
    parser.add_argument("--reads", type=int, default=READS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.feed:
        _feed_streams(args.feed, args.reads)
        return 0
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = set(names) - set(CASES)
    if unknown:
        parser.error(f"unknown cases: {', '.join(sorted(unknown))}")
    figures: dict[str, dict[str, float]] = {}
    for name in names:
        figures[name] = {"bytecodes": bytecodes(name)}
        if args.instructions:
            figures[name]["instructions"] = round(instructions(name))
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(f"per relayed read (one event, the {COUNTED}th of {READS}):")
    for name, figure in figures.items():
        line = f"  {name:<10} {figure['bytecodes']:>6,.0f} bytecodes"
        if "instructions" in figure:
            line += f"   {figure['instructions']:>8,.0f} instructions"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
