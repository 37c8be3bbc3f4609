"""The vLLM stub's KV connectors: what a prefill hands off and how a decode checks it.

``shfs`` (NixlConnector, pull, sequential P then D):

    P: kv_transfer_params.do_remote_decode -> hold blocks (lease) -> answer
       {do_remote_prefill: true, do_remote_decode: false, remote_block_ids: [[...]],
        remote_engine_id, remote_request_id, remote_host: "localhost", remote_port: <P's
        HTTP port>, tp_size, dcp_size, pp_size, remote_num_tokens, remote_blocks_expiry_time,
        transfer_mode, remote_prefill_cached_tokens}: the keys and order of vLLM 0.32.0's
        recorded answers (tests/fixtures/vllm/0.32.0)
    D: kv_transfer_params.do_remote_prefill -> GET http://remote_host:remote_port/_stub/nixl/<id>
       (so a wrong host or port really fails) -> engine id, block ids and prompt must match

``nixl`` (vLLM on AWS Neuron): D reads ``disagg_prefill_resp`` (the whole prefill answer)
and checks its first token and prompt length against its own prompt.

``mooncake`` (MooncakeConnector, push, P and D concurrent): P serves ``GET /query`` on its
bootstrap port and, after prefilling a request with ``transfer_id`` T, "pushes" it; D with
{transfer_id, remote_bootstrap_addr, remote_engine_id} checks the engine id against
``/query`` and waits (bounded) for the push of T, in either arrival order.

Any missing key or mismatch makes D recompute locally, as vLLM does: the output differs
(``textgen.PrefillKind.LOCAL``) and the verdict is recorded, never sent to the client.

Deliberate limits: one KV-cache group, tp_size 1, dp_rank 0; the "KV" is the prompt digest.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol
from urllib.parse import quote

import aiohttp
from aiohttp import web

from sidecar.stubs.faults import Fault, FaultKind
from sidecar.stubs.openai import GenRequest
from sidecar.stubs.replies import json_response
from sidecar.stubs.textgen import PrefillKind, decode_tokens, token_at

if TYPE_CHECKING:
    from sidecar.stubs.server import Stub

NIXL_REQUIRED: Final = (
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
)
MOONCAKE_REQUIRED: Final = ("transfer_id", "remote_bootstrap_addr", "remote_engine_id")


@dataclass(frozen=True)
class Verdict:
    kind: PrefillKind
    reason: str


REMOTE_OK: Final = Verdict(PrefillKind.REMOTE, "ok")


def local(reason: str) -> Verdict:
    return Verdict(PrefillKind.LOCAL, reason)


@dataclass
class HeldKV:
    digest: int
    block_ids: list[list[int]]
    num_tokens: int
    expires: float

    def payload(self, engine_id: str) -> dict[str, Any]:
        return {
            "engine_id": engine_id,
            "prompt_digest": f"{self.digest:016x}",
            "block_ids": self.block_ids,
            "num_tokens": self.num_tokens,
        }


class Connector(Protocol):
    def add_routes(self, app: web.Application) -> None: ...

    def add_bootstrap_routes(self, app: web.Application) -> None: ...

    async def check_handoff(self, gen: GenRequest) -> Verdict | None:
        """Decode side: None when the request carries no hand-off at all."""
        ...

    def after_prefill(
        self, gen: GenRequest, request_id: str, finish: str, fault: Fault | None
    ) -> dict[str, Any] | None:
        """Prefill side: the response's kv_transfer_params (None: null)."""
        ...

    def held(self) -> int: ...

    def close(self) -> None: ...


def _params(gen: GenRequest) -> dict[str, Any] | None:
    value = gen.body.get("kv_transfer_params")
    return value if isinstance(value, dict) else None


def _flat(block_ids: Any) -> list[int] | None:
    """Block ids as one flat list (vLLM sent a flat list before KV-cache groups)."""
    if not isinstance(block_ids, list):
        return None
    if block_ids and all(isinstance(g, list) for g in block_ids):
        return [b for g in block_ids for b in g]
    return list(block_ids)


def _expire(store: OrderedDict[str, HeldKV]) -> None:
    # Entries are inserted with a constant lease, so the oldest expires first.
    now = time.monotonic()
    while store:
        key, first = next(iter(store.items()))
        if first.expires > now:
            break
        del store[key]


class _Blocks:
    """A toy block allocator: consecutive ids, wrapping, never 0 (vLLM's null block)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._next = 1

    def allocate(self, num_tokens: int) -> list[int]:
        n = max(1, math.ceil(num_tokens / self.block_size))
        if self._next + n >= 1 << 20:
            self._next = 1
        start = self._next
        self._next += n
        return list(range(start, start + n))


async def _get_json(stub: Stub, url: str, timeout_s: float) -> tuple[int, Any]:
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=stub.config.pull_timeout_s)
    async with stub.session.get(url, timeout=timeout) as resp:
        data = await resp.json(content_type=None) if resp.status == 200 else None
        return resp.status, data


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class NixlConnector:
    """vLLM NixlConnector (the seed's ``shfs``): pull model."""

    def __init__(self, stub: Stub) -> None:
        self.stub = stub
        self.store: OrderedDict[str, HeldKV] = OrderedDict()
        self.blocks = _Blocks(stub.config.block_size)
        self.pulled = 0

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/_stub/nixl/{request_id}", self._pull)

    def add_bootstrap_routes(self, app: web.Application) -> None:
        return None

    async def _pull(self, request: web.Request) -> web.StreamResponse:
        _expire(self.store)
        held = self.store.pop(request.match_info["request_id"], None)
        if held is None:
            return json_response({"error": "unknown or expired request"}, 404)
        self.pulled += 1
        return json_response(held.payload(self.stub.engine_id))

    def after_prefill(
        self, gen: GenRequest, request_id: str, finish: str, fault: Fault | None
    ) -> dict[str, Any] | None:
        params = _params(gen)
        if params is None or not params.get("do_remote_decode"):
            return None
        # vLLM returns params only when the prefill ended by the length cap.
        if finish != "length" or (fault is not None and fault.kind is FaultKind.NO_HANDOFF):
            return None
        cfg = self.stub.config
        _expire(self.store)
        block_ids = [self.blocks.allocate(len(gen.prompt_ids))]
        expires = time.monotonic() + cfg.kv_lease_s
        self.store[request_id] = HeldKV(gen.digest, block_ids, len(gen.prompt_ids), expires)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": block_ids,
            "remote_engine_id": self.stub.engine_id,
            "remote_request_id": request_id,
            "remote_host": cfg.side_channel_host,
            "remote_port": self.stub.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": len(gen.prompt_ids),
            # vLLM 0.32.0 answers null here in pull mode (tests/fixtures/vllm/0.32.0).
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": 0,
        }

    async def check_handoff(self, gen: GenRequest) -> Verdict | None:
        params = _params(gen)
        if params is None or not params.get("do_remote_prefill"):
            return None
        if any(params.get(key) is None for key in NIXL_REQUIRED):
            return local("missing_params")
        url = (
            f"http://{_host(str(params['remote_host']))}:{params['remote_port']}"
            f"/_stub/nixl/{quote(str(params['remote_request_id']), safe='')}"
        )
        try:
            status, data = await _get_json(self.stub, url, self.stub.config.pull_timeout_s)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return local("pull_failed")
        if status == 404:
            return local("unknown_request")
        if status != 200 or not isinstance(data, dict):
            return local("pull_failed")
        if data.get("engine_id") != params["remote_engine_id"]:
            return local("engine_mismatch")
        if _flat(data.get("block_ids")) != _flat(params["remote_block_ids"]):
            return local("block_mismatch")
        if data.get("prompt_digest") != f"{gen.digest:016x}":
            return local("prompt_mismatch")
        return REMOTE_OK

    def held(self) -> int:
        _expire(self.store)
        return len(self.store)

    def close(self) -> None:
        self.store.clear()


class NeuronConnector:
    """vLLM on AWS Neuron (the seed's ``nixl``): the decode gets the whole prefill answer."""

    def __init__(self, stub: Stub) -> None:
        self.stub = stub

    def add_routes(self, app: web.Application) -> None:
        return None

    def add_bootstrap_routes(self, app: web.Application) -> None:
        return None

    def after_prefill(
        self, gen: GenRequest, request_id: str, finish: str, fault: Fault | None
    ) -> dict[str, Any] | None:
        return None

    async def check_handoff(self, gen: GenRequest) -> Verdict | None:
        if "disagg_prefill_resp" not in gen.body:
            return None
        resp = gen.body["disagg_prefill_resp"]
        if not isinstance(resp, dict):
            return local("malformed_handoff")
        choices = resp.get("choices")
        usage = resp.get("usage")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return local("malformed_handoff")
        choice = choices[0]
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else choice.get("text")
        if not isinstance(usage, dict) or usage.get("prompt_tokens") != len(gen.prompt_ids):
            return local("prompt_mismatch")
        if text != decode_tokens([token_at(gen.digest, 0, PrefillKind.REMOTE)]):
            return local("prompt_mismatch")
        return REMOTE_OK

    def held(self) -> int:
        return 0

    def close(self) -> None:
        return None


@dataclass
class _Slot:
    event: asyncio.Event
    held: HeldKV | None = None


class MooncakeConnector:
    """vLLM MooncakeConnector: push model, P and D concurrent, paired by transfer_id."""

    def __init__(self, stub: Stub) -> None:
        self.stub = stub
        self.slots: dict[str, _Slot] = {}
        self.blocks = _Blocks(stub.config.block_size)
        self.pushed = 0

    def _slot(self, transfer_id: str) -> _Slot:
        slot = self.slots.get(transfer_id)
        if slot is None:
            slot = self.slots[transfer_id] = _Slot(asyncio.Event())
        return slot

    def add_routes(self, app: web.Application) -> None:
        return None

    def add_bootstrap_routes(self, app: web.Application) -> None:
        app.router.add_get("/query", self._query)
        app.router.add_post("/register", self._register)
        app.router.add_get("/_stub/mooncake/{transfer_id}", self._wait_push)

    def query_body(self) -> dict[str, Any]:
        addr = f"{self.stub.config.host}:{self.stub.bootstrap_port}"
        entry = {"engine_id": self.stub.engine_id, "worker_addr": {"0": {"0": addr}}}
        if self.stub.config.mooncake_query_shape == "engine_id":
            return {self.stub.engine_id: {"dp_rank": 0, "worker_addr": {"0": {"0": addr}}}}
        return {"0": entry}

    async def _query(self, request: web.Request) -> web.StreamResponse:
        return json_response(self.query_body())

    async def _register(self, request: web.Request) -> web.StreamResponse:
        return json_response({"status": "ok"})

    async def _wait_push(self, request: web.Request) -> web.StreamResponse:
        transfer_id = request.match_info["transfer_id"]
        try:
            timeout = float(request.query.get("timeout", self.stub.config.waiting_timeout_s))
        except ValueError:
            return json_response({"error": "bad timeout"}, 400)
        slot = self._slot(transfer_id)
        try:
            async with asyncio.timeout(timeout):
                await slot.event.wait()
        except TimeoutError:
            if self.slots.get(transfer_id) is slot and slot.held is None:
                del self.slots[transfer_id]
            return json_response({"error": f"transfer {transfer_id} not pushed in time"}, 408)
        self.slots.pop(transfer_id, None)
        if slot.held is None:  # the slot was cleared (stub stopping)
            return json_response({"error": "gone"}, 410)
        return json_response(slot.held.payload(self.stub.engine_id))

    def after_prefill(
        self, gen: GenRequest, request_id: str, finish: str, fault: Fault | None
    ) -> dict[str, Any] | None:
        params = _params(gen)
        if params is None or not params.get("do_remote_decode"):
            return None
        transfer_id = params.get("transfer_id")
        if not transfer_id or finish != "length":
            return None
        if fault is not None and fault.kind is FaultKind.NO_HANDOFF:
            return None
        self._expire()
        slot = self._slot(str(transfer_id))
        expires = time.monotonic() + self.stub.config.kv_lease_s
        slot.held = HeldKV(
            gen.digest, [self.blocks.allocate(len(gen.prompt_ids))], len(gen.prompt_ids), expires
        )
        slot.event.set()
        self.pushed += 1
        return None  # MooncakeConnector.request_finished returns no params

    def _expire(self) -> None:
        now = time.monotonic()
        stale = [t for t, s in self.slots.items() if s.held is not None and s.held.expires <= now]
        for transfer_id in stale:
            del self.slots[transfer_id]

    async def check_handoff(self, gen: GenRequest) -> Verdict | None:
        params = _params(gen)
        if params is None or not params.get("do_remote_prefill"):
            return None
        if any(not params.get(key) for key in MOONCAKE_REQUIRED):
            return local("missing_params")
        addr = str(params["remote_bootstrap_addr"]).rstrip("/")
        if "://" not in addr:
            addr = "http://" + addr
        cfg = self.stub.config
        try:
            status, data = await _get_json(self.stub, addr + "/query", cfg.pull_timeout_s)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return local("bootstrap_failed")
        if status != 200 or not isinstance(data, dict):
            return local("bootstrap_failed")
        engine_id = params["remote_engine_id"]
        known = set(data) | {v.get("engine_id") for v in data.values() if isinstance(v, dict)}
        if engine_id not in known:
            return local("engine_mismatch")
        url = (
            f"{addr}/_stub/mooncake/{quote(str(params['transfer_id']), safe='')}"
            f"?timeout={cfg.waiting_timeout_s}"
        )
        try:
            wait_s = cfg.waiting_timeout_s + cfg.pull_timeout_s
            status, data = await _get_json(self.stub, url, wait_s)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return local("pull_failed")
        if status == 408:
            return local("transfer_timeout")
        if status != 200 or not isinstance(data, dict):
            return local("pull_failed")
        if data.get("prompt_digest") != f"{gen.digest:016x}":
            return local("prompt_mismatch")
        return REMOTE_OK

    def held(self) -> int:
        self._expire()
        return sum(1 for s in self.slots.values() if s.held is not None)

    def close(self) -> None:
        self.slots.clear()


def make_connector(stub: Stub) -> Connector:
    name = stub.config.kv_connector
    if name == "shfs":
        return NixlConnector(stub)
    if name == "nixl":
        return NeuronConnector(stub)
    return MooncakeConnector(stub)
