"""vLLM NixlConnector hand-offs for the lean engine: issued by a prefill, checked by a decode.

    prefill  Issuer.issue(response id, prompt)  ─▶ kv_transfer_params (vLLM 0.32's keys, order)
    decode   Checker.check(params, prompt)      ─▶ Verdict now, or a coroutine the first time
                                                  it meets that prefill (the handshake)

As with NIXL, a decode meets each prefill once through its side channel: ``GET
/_lean/nixl/handshake`` on the hand-off's ``remote_host:remote_port`` (so a wrong host or
port really fails) tells the prefill's engine id and the key it signs hand-offs with; it is
cached per address. After that a hand-off costs the prefill's HTTP server nothing, as a
NIXL transfer costs vLLM's API server nothing. The signature (in ``remote_request_id``'s
suffix, where vLLM puts a random one) covers the engine id, the request id, the block ids
and the prompt (token count and digest), so the decode accepts only a hand-off that prefill
issued for this very prompt; each is accepted once (a reused one is ``unknown_request``,
as blocks already read would be).

Verdicts are ``(outcome, reason)``: ``remote/ok`` or ``local/<why>``, as the aiohttp stubs
record them (``missing_params``, ``pull_failed``, ``engine_mismatch``, ``block_mismatch``,
``unknown_request``).

Deliberate limits: the prefill holds no KV (no lease, no expiry); one KV-cache group,
tp_size 1; a handshake answer is trusted for the life of the process.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import math
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Final

Verdict = tuple[str, str]

REMOTE_OK: Final[Verdict] = ("remote", "ok")
HANDSHAKE_PATH: Final = "/_lean/nixl/handshake"
REQUIRED: Final = (
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
)
_USED_LIMIT: Final = 1 << 16


def local(reason: str) -> Verdict:
    return ("local", reason)


def sign(
    key: bytes, engine_id: str, prefix: str, blocks: list[int], tokens: int, digest: int
) -> str:
    data = f"{engine_id}|{prefix}|{','.join(map(str, blocks))}|{tokens}|{digest:016x}"
    return hashlib.blake2b(data.encode(), key=key, digest_size=8).hexdigest()


class Issuer:
    """The prefill side: allocates block ids and signs the hand-off."""

    def __init__(self, engine_id: str, port: int, side_channel_host: str, block_size: int) -> None:
        self.engine_id = engine_id
        self.port = port
        self.side_channel_host = side_channel_host
        self.block_size = block_size
        self.key = secrets.token_bytes(16)
        self._next = 1

    def handshake(self) -> dict[str, str]:
        return {"engine_id": self.engine_id, "key": self.key.hex()}

    def issue(self, response_id: str, digest: int, prompt_tokens: int) -> dict[str, Any]:
        n = max(1, math.ceil(prompt_tokens / self.block_size))
        if self._next + n >= 1 << 20:
            self._next = 1  # wrap, never block 0 (vLLM's null block)
        blocks = list(range(self._next, self._next + n))
        self._next += n
        prefix = f"{response_id}-0"
        tag = sign(self.key, self.engine_id, prefix, blocks, prompt_tokens, digest)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [blocks],
            "remote_engine_id": self.engine_id,
            "remote_request_id": f"{prefix}-{tag}",
            "remote_host": self.side_channel_host,
            "remote_port": self.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": prompt_tokens,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": 0,
        }


@dataclass(frozen=True, slots=True)
class Peer:
    engine_id: str
    key: bytes


Handshake = Callable[[str, int], Awaitable[Peer]]


def _flat(block_ids: Any) -> list[int] | None:
    if not isinstance(block_ids, list):
        return None
    if block_ids and all(isinstance(g, list) for g in block_ids):
        block_ids = [b for g in block_ids for b in g]
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in block_ids):
        return None
    return list(block_ids)


class Checker:
    """The decode side: judges a hand-off against the prefill that claims to have issued it."""

    def __init__(self, handshake: Handshake) -> None:
        self._handshake = handshake
        self.peers: dict[tuple[str, int], Peer] = {}
        self._meeting: dict[tuple[str, int], asyncio.Future[Peer]] = {}
        self._used: OrderedDict[str, None] = OrderedDict()

    def check(
        self, params: Any, digest: int, prompt_tokens: int
    ) -> Verdict | Coroutine[Any, Any, Verdict] | None:
        """None: no hand-off at all; a Verdict; or a coroutine giving one (first meeting)."""
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return None
        if any(params.get(key) is None for key in REQUIRED):
            return local("missing_params")
        port = params["remote_port"]
        if isinstance(port, bool) or not isinstance(port, int):
            return local("missing_params")
        addr = (str(params["remote_host"]), port)
        peer = self.peers.get(addr)
        if peer is None:
            return self._meet_then_verify(addr, params, digest, prompt_tokens)
        return self._verify(peer, params, digest, prompt_tokens)

    async def _meet_then_verify(
        self, addr: tuple[str, int], params: dict[str, Any], digest: int, prompt_tokens: int
    ) -> Verdict:
        meeting = self._meeting.get(addr)
        if meeting is None:
            meeting = asyncio.ensure_future(self._handshake(*addr))
            self._meeting[addr] = meeting
            meeting.add_done_callback(lambda _: self._meeting.pop(addr, None))
        try:
            peer = await asyncio.shield(meeting)
        except (OSError, TimeoutError, ValueError, KeyError):
            return local("pull_failed")
        self.peers[addr] = peer
        return self._verify(peer, params, digest, prompt_tokens)

    def _verify(
        self, peer: Peer, params: dict[str, Any], digest: int, prompt_tokens: int
    ) -> Verdict:
        if params["remote_engine_id"] != peer.engine_id:
            return local("engine_mismatch")
        blocks = _flat(params["remote_block_ids"])
        if blocks is None:
            return local("block_mismatch")
        request_id = str(params["remote_request_id"])
        prefix, _, tag = request_id.rpartition("-")
        expected = sign(peer.key, peer.engine_id, prefix, blocks, prompt_tokens, digest)
        if not hmac.compare_digest(tag, expected):
            # Blocks, request id or prompt differ from what that prefill issued.
            return local("block_mismatch")
        if request_id in self._used:
            return local("unknown_request")
        self._used[request_id] = None
        if len(self._used) > _USED_LIMIT:
            self._used.popitem(last=False)
        return REMOTE_OK
