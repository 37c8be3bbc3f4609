"""The stub engines' hand-off behaviour, written once for both transports (no I/O here).

Both transports (aiohttp, ``sidecar.tools.stubs.server``; lean, ``sidecar.tools.stubs.lean``)
take from this module what a stub engine *is* and *decides*; they only move bytes:

    info()             the identity a stub prints when listening and serves at /_stub/info
    Verdict, Tally     a decode's verdict on its hand-off; the counts behind the metric
                       ``stub_handoff_total{outcome,reason}`` (what ``bench.run`` reads)
    NixlHolder         vLLM NixlConnector, prefill side: blocks held under a lease, the
                       ``kv_transfer_params`` it answers, the entry a decode pulls (once)
    nixl_pull_target   decode side, before the pull: no hand-off, a local verdict at once,
                       or where to pull from (``GET /_stub/nixl/<request id>`` on
                       ``remote_host:remote_port``)
    judge_nixl_pull    decode side, after the pull: remote/ok or local/<why>
    sglang_*           SGLang rendezvous: the decode's verdict before it waits, the digest
                       it compares, the engines' timeout wording

NIXL verdicts: ``missing_params`` (a required key null or absent, a port that is no port),
``block_mismatch`` (the block ids do not fit this prompt, or are not the ones held),
``pull_failed`` (nothing answered), ``unknown_request`` (nothing held under that id: never
issued, expired or already pulled), ``engine_mismatch``, ``prompt_mismatch``.

Deliberate limits: one KV-cache group, tp_size 1; the "KV" is the prompt digest.
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote

from sidecar.tools.stubs.config import StubConfig
from sidecar.tools.stubs.textgen import PrefillKind

NIXL_PULL_PREFIX: Final = "/_stub/nixl/"
NIXL_REQUIRED: Final = (
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
)


@dataclass(frozen=True, slots=True)
class Verdict:
    """A decode's verdict on the hand-off it was given (which words it generates)."""

    kind: PrefillKind
    reason: str

    @property
    def outcome(self) -> str:
        return self.kind.value


REMOTE_OK: Final = Verdict(PrefillKind.REMOTE, "ok")


def local(reason: str) -> Verdict:
    return Verdict(PrefillKind.LOCAL, reason)


class Tally:
    """Counts of decode verdicts, rendered as the ``stub_handoff_total`` metric lines."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()

    def count(self, verdict: Verdict) -> None:
        self.counts[(verdict.outcome, verdict.reason)] += 1

    def metric_lines(self) -> list[str]:
        lines = [
            "# HELP stub_handoff_total Decode hand-off verdicts of the stub engine.",
            "# TYPE stub_handoff_total counter",
        ]
        for (outcome, reason), count in sorted(self.counts.items()):
            lines.append(f'stub_handoff_total{{outcome="{outcome}",reason="{reason}"}} {count}')
        return lines


def info(
    config: StubConfig, engine_id: str, port: int, bootstrap_port: int | None
) -> dict[str, Any]:
    """What a stub says about itself (the "listening" line, ``/_stub/info``)."""
    return {
        "engine": config.engine,
        "role": config.role,
        "kv_connector": config.kv_connector if config.engine == "vllm" else None,
        "engine_id": engine_id,
        "host": config.host,
        "port": port,
        "bootstrap_port": bootstrap_port,
        "model": config.model,
        "transport": config.transport,
    }


def url_host(host: str) -> str:
    """``host`` as it stands in a URL (IPv6 in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


# -- vLLM NixlConnector (label ``shfs``): pull model ----------------------------------


def flat_block_ids(block_ids: Any) -> list[int] | None:
    """Block ids as one flat list (vLLM sent a flat list before KV-cache groups)."""
    if not isinstance(block_ids, list):
        return None
    if block_ids and all(isinstance(g, list) for g in block_ids):
        block_ids = [b for g in block_ids for b in g]
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in block_ids):
        return None
    return list(block_ids)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return max(1, math.ceil(num_tokens / block_size))


@dataclass(slots=True)
class HeldKV:
    digest: int
    block_ids: list[list[int]]
    num_tokens: int
    expires: float
    #: The KV identity of the data-parallel rank that holds it (None: the engine's own).
    engine_id: str | None = None

    def payload(self, engine_id: str) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id or engine_id,
            "prompt_digest": f"{self.digest:016x}",
            "block_ids": self.block_ids,
            "num_tokens": self.num_tokens,
        }


class BlockAllocator:
    """A toy block allocator: consecutive ids, wrapping, never 0 (vLLM's null block)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._next = 1

    def allocate(self, num_tokens: int) -> list[int]:
        n = blocks_for(num_tokens, self.block_size)
        if self._next + n >= 1 << 20:
            self._next = 1
        start = self._next
        self._next += n
        return list(range(start, start + n))


class NixlHolder:
    """A NIXL prefill's held blocks: issued with a lease, pulled (and freed) at most once."""

    def __init__(self, config: StubConfig, engine_id: str) -> None:
        self.config = config
        self.engine_id = engine_id
        self.store: OrderedDict[str, HeldKV] = OrderedDict()
        self.blocks = BlockAllocator(config.block_size)
        self.pulled = 0

    def issue(self, request_id: str, digest: int, num_tokens: int, port: int,
              engine_id: str | None = None, cached_tokens: int = 0) -> dict[str, Any]:
        """Hold this prompt's blocks; the ``kv_transfer_params`` the prefill answers
        (``engine_id``: the holding data-parallel rank's, None: the engine's own;
        ``cached_tokens``: the prefill's own prefix-cache hits, which vLLM 0.32 hands on)."""
        self._expire()
        block_ids = [self.blocks.allocate(num_tokens)]
        expires = time.monotonic() + self.config.kv_lease_s
        self.store[request_id] = HeldKV(digest, block_ids, num_tokens, expires, engine_id)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": block_ids,
            "remote_engine_id": engine_id or self.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.config.side_channel_host,
            "remote_port": port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": num_tokens,
            # vLLM 0.32.0 answers null here in pull mode (tests/fixtures/vllm/0.32.0).
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": cached_tokens,
        }

    def take(self, request_id: str) -> dict[str, Any] | None:
        """The pull: the held entry's payload, freed; None when nothing is held under it."""
        self._expire()
        held = self.store.pop(request_id, None)
        if held is None:
            return None
        self.pulled += 1
        return held.payload(self.engine_id)

    def held(self) -> int:
        self._expire()
        return len(self.store)

    def clear(self) -> None:
        self.store.clear()

    def _expire(self) -> None:
        # Entries are inserted with a constant lease, so the oldest expires first.
        now = time.monotonic()
        store = self.store
        while store:
            key, first = next(iter(store.items()))
            if first.expires > now:
                break
            del store[key]


def wants_nixl_prefill(params: Any) -> bool:
    """A prefill leg: the body asks the engine to hold its KV for a decode."""
    return isinstance(params, dict) and bool(params.get("do_remote_decode"))


@dataclass(frozen=True, slots=True)
class PullTarget:
    """Where a decode pulls its hand-off's blocks, and what it expects to find there."""

    host: str
    port: int
    request_id: str
    engine_id: str
    block_ids: list[int]

    @property
    def path(self) -> str:
        return NIXL_PULL_PREFIX + quote(self.request_id, safe="")

    @property
    def url(self) -> str:
        return f"http://{url_host(self.host)}:{self.port}{self.path}"


def nixl_pull_target(
    params: Any, prompt_tokens: int, block_size: int
) -> PullTarget | Verdict | None:
    """Decode side, before any I/O: None (no hand-off), a local verdict, or where to pull."""
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return None
    if any(params.get(key) is None for key in NIXL_REQUIRED):
        return local("missing_params")
    port = params["remote_port"]
    if isinstance(port, bool) or not isinstance(port, int):
        return local("missing_params")
    blocks = flat_block_ids(params["remote_block_ids"])
    # The decode allocates blocks for its own prompt; ids that do not fit cannot be read.
    if blocks is None or len(blocks) != blocks_for(prompt_tokens, block_size):
        return local("block_mismatch")
    return PullTarget(
        str(params["remote_host"]),
        port,
        str(params["remote_request_id"]),
        str(params["remote_engine_id"]),
        blocks,
    )


def judge_nixl_pull(target: PullTarget, status: int, pulled: Any, digest: int) -> Verdict:
    """Decode side, after the pull answered ``status`` with ``pulled`` (parsed JSON)."""
    if status == 404:
        return local("unknown_request")
    if status != 200 or not isinstance(pulled, dict):
        return local("pull_failed")
    if pulled.get("engine_id") != target.engine_id:
        return local("engine_mismatch")
    if flat_block_ids(pulled.get("block_ids")) != target.block_ids:
        return local("block_mismatch")
    if pulled.get("prompt_digest") != f"{digest:016x}":
        return local("prompt_mismatch")
    return REMOTE_OK


# -- SGLang: bootstrap rendezvous by room ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where a decode meets its prefill: the prefill's bootstrap server and the room."""

    host: str
    port: int
    room: int


def sglang_room(body: dict[str, Any]) -> int | None:
    """The body's ``bootstrap_room`` (ValueError when it is not an integer)."""
    room = body.get("bootstrap_room")
    if room is not None and (isinstance(room, bool) or not isinstance(room, int)):
        raise ValueError("bootstrap_room must be an integer")
    return room


def sglang_decode_target(body: dict[str, Any], room: int | None) -> Rendezvous | Verdict:
    """Decode side, before waiting: a local verdict, or where to meet the prefill."""
    if room is None:
        return local("no_handoff")
    host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
    if not isinstance(host, str) or not host or isinstance(port, bool) or not isinstance(port, int):
        return local("missing_params")
    return Rendezvous(host, port, room)


def sglang_judge(handed_digest: int, digest: int) -> Verdict:
    """Decode side, after the prefill handed over: same prompt or not."""
    return REMOTE_OK if handed_digest == digest else local("prompt_mismatch")


def sglang_prefill_timeout(rid: str, room: int, timeout_s: float) -> str:
    return (
        f"Prefill bootstrap failed for request rank=0 req.rid='{rid}' "
        f"req.bootstrap_room={room} with exception KVTransferError("
        f"bootstrap_room={room}): Request {room} timed out after {timeout_s}s in "
        "KVPoll.Bootstrapping"
    )


def sglang_decode_failure(rid: str, room: int, why: str) -> str:
    return (
        f"Decode transfer failed for request rank=0 decode_req.req.rid='{rid}' "
        f"decode_req.req.bootstrap_room={room} with exception "
        f"KVTransferError(bootstrap_room={room}): {why}"
    )


def sglang_decode_timeout(rid: str, room: int, timeout_s: float) -> str:
    return sglang_decode_failure(
        rid, room, f"Request {room} timed out after {timeout_s}s in KVPoll.WaitingForInput"
    )
