"""The vLLM stub's KV connectors: what a prefill hands off and how a decode checks it.

``shfs`` (NixlConnector, pull, sequential P then D):

    P: kv_transfer_params.do_remote_decode -> hold blocks (lease) -> answer
       {do_remote_prefill: true, do_remote_decode: false, remote_block_ids: [[...]],
        remote_engine_id, remote_request_id, remote_host: "localhost", remote_port: <P's
        HTTP port>, tp_size, dcp_size, pp_size, remote_num_tokens, remote_blocks_expiry_time,
        transfer_mode, remote_prefill_cached_tokens}: the keys and order of vLLM 0.32.0's
        recorded answers (tests/fixtures/vllm/0.32.0)
    D: kv_transfer_params.do_remote_prefill -> block ids must fit its prompt -> GET
       http://remote_host:remote_port/_stub/nixl/<id> (so a wrong host or port really fails)
       -> engine id, block ids and prompt must match (``handoff``: the same rules as the
       lean transport's)

``nixl`` (vLLM on AWS Neuron): D reads ``disagg_prefill_resp`` (the whole prefill answer)
and checks its first token and prompt length against its own prompt.

``mooncake`` (MooncakeConnector, push, P and D concurrent): P serves ``GET /query`` on its
bootstrap port and, after prefilling a request with ``transfer_id`` T, "pushes" it; D with
{transfer_id, remote_bootstrap_addr, remote_engine_id} checks the engine id against
``/query`` and waits (bounded) for the push of T, in either arrival order.

``nixl-push`` (NixlPushConnector, push, P and D in either order, paired by the request id):
P, after prefilling with ``do_remote_decode``, holds the KV under the request's base id (its
internal id without the last ``-<8 hex>``, as vLLM's ``get_base_request_id``) and answers the
push params (``transfer_mode: "push"``, ``remote_port``: the stub's HTTP port as its "side
channel"); D with {remote_engine_id, remote_host, remote_port, tp_size, remote_request_id}
"registers" at ``GET http://remote_host:remote_port/_stub/nixl-push/<base id>?engine_id=E``,
which answers 409 at once when E is none of P's engine ids (D then fails the request as vLLM
does after its handshake's "Remote NIXL agent engine ID mismatch": JSON HTTP 500, a stream
HTTP 200 with an error event first, ``EngineFailed``; but an id D registered with before
makes it wait out its timeout, as vLLM notifies the gone agent it keeps) and otherwise
waits (bounded) for P's KV of that base id; a KV of another prompt recomputes locally.

Any missing key or mismatch makes D recompute locally, as vLLM does: the output differs
(``textgen.PrefillKind.LOCAL``) and the verdict is recorded, never sent to the client.

Data-parallel ranks (``StubConfig.data_parallel_size``): a prefill on rank r holds its KV
under that rank's engine id (``<id>_dp<r>``, as vLLM suffixes it), which its NIXL hand-off
names; a Mooncake ``/query`` lists every rank's entry, and a decode naming another rank's
engine id than the one that holds its transfer recomputes locally (``engine_mismatch``).

Deliberate limits: one KV-cache group, tp_size 1; every rank's NIXL pull is served on the
stub's HTTP port (vLLM: a side-channel port per rank); the "KV" is the prompt digest.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol
from urllib.parse import quote

import aiohttp
from aiohttp import web

from sidecar.tools.stubs.faults import Fault, FaultKind
from sidecar.tools.stubs.handoff import (
    NIXL_PULL_PREFIX,
    REMOTE_OK,
    BlockAllocator,
    HeldKV,
    NixlHolder,
    PullTarget,
    Verdict,
    judge_nixl_pull,
    local,
    nixl_pull_target,
    wants_nixl_prefill,
)
from sidecar.tools.stubs.openai import GenRequest
from sidecar.tools.stubs.replies import json_response
from sidecar.tools.stubs.textgen import PrefillKind, decode_tokens, token_at

if TYPE_CHECKING:
    from sidecar.tools.stubs.server import Stub

MOONCAKE_REQUIRED: Final = ("transfer_id", "remote_bootstrap_addr", "remote_engine_id")


class Connector(Protocol):
    def add_routes(self, app: web.Application) -> None: ...

    def add_bootstrap_routes(self, app: web.Application) -> None: ...

    async def check_handoff(self, gen: GenRequest) -> Verdict | None:
        """Decode side: None when the request carries no hand-off at all."""
        ...

    def after_prefill(
        self, gen: GenRequest, request_id: str, finish: str, fault: Fault | None, rank: int
    ) -> dict[str, Any] | None:
        """Prefill side, on data-parallel ``rank``: the response's kv_transfer_params (None:
        null)."""
        ...

    def held(self) -> int: ...

    def close(self) -> None: ...


def _params(gen: GenRequest) -> dict[str, Any] | None:
    value = gen.body.get("kv_transfer_params")
    return value if isinstance(value, dict) else None


async def _get_json(stub: Stub, url: str, timeout_s: float) -> tuple[int, Any]:
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=stub.config.pull_timeout_s)
    async with stub.session.get(url, timeout=timeout) as resp:
        data = await resp.json(content_type=None) if resp.status == 200 else None
        return resp.status, data


class NixlConnector:
    """vLLM NixlConnector (label ``shfs``, docs/driving/handoffs.md#vllm-nixl-pull): pull model
    (``handoff.NixlHolder``)."""

    def __init__(self, stub: Stub) -> None:
        self.stub = stub
        self.holder = NixlHolder(stub.config, stub.engine_id)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(NIXL_PULL_PREFIX + "{request_id}", self._pull)

    def add_bootstrap_routes(self, app: web.Application) -> None:
        return None

    async def _pull(self, request: web.Request) -> web.StreamResponse:
        payload = self.holder.take(request.match_info["request_id"])
        if payload is None:
            return json_response({"error": "unknown or expired request"}, 404)
        return json_response(payload)

    def after_prefill(
        self, gen: GenRequest, request_id: str, finish: str, fault: Fault | None, rank: int
    ) -> dict[str, Any] | None:
        if not wants_nixl_prefill(_params(gen)):
            return None
        # vLLM returns params only when the prefill ended by the length cap.
        if finish != "length" or (fault is not None and fault.kind is FaultKind.NO_HANDOFF):
            return None
        return self.holder.issue(request_id, gen.digest, len(gen.prompt_ids), self.stub.port,
                                 self.stub.ranks.engine_id(self.stub.engine_id, rank),
                                 int(gen.extra.get("cached_tokens", 0)))

    async def check_handoff(self, gen: GenRequest) -> Verdict | None:
        cfg = self.stub.config
        target = nixl_pull_target(_params(gen), len(gen.prompt_ids), cfg.block_size)
        if not isinstance(target, PullTarget):
            return target
        try:
            status, data = await _get_json(self.stub, target.url, cfg.pull_timeout_s)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return local("pull_failed")
        return judge_nixl_pull(target, status, data, gen.digest)

    def held(self) -> int:
        return self.holder.held()

    def close(self) -> None:
        self.holder.clear()


class NeuronConnector:
    """vLLM on AWS Neuron (label ``nixl``, docs/driving/handoffs.md#neuron-nixl): the decode gets
    the whole
    prefill answer."""

    def __init__(self, stub: Stub) -> None:
        self.stub = stub

    def add_routes(self, app: web.Application) -> None:
        return None

    def add_bootstrap_routes(self, app: web.Application) -> None:
        return None

    def after_prefill(
        self, gen: GenRequest, request_id: str, finish: str, fault: Fault | None, rank: int
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


class HeldSlots:
    """KV a push-model prefill holds for a decode that waits on it, by the pairing key
    (Mooncake's transfer id, NIXL push's base request id), each until its lease ends."""

    def __init__(self) -> None:
        self._slots: dict[str, _Slot] = {}

    def _slot(self, key: str) -> _Slot:
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _Slot(asyncio.Event())
        return slot

    def hold(self, key: str, held: HeldKV) -> None:
        """The prefill ended: ``held`` waits for its decode (which may already wait)."""
        self.expire()
        slot = self._slot(key)
        slot.held = held
        slot.event.set()

    async def wait(self, key: str, request: web.Request, *, default_timeout_s: float,
                   engine_id: str, late_error: str) -> web.StreamResponse:
        """A decode's wait for ``key`` (its ``?timeout=`` or ``default_timeout_s``): the
        held KV's payload, 408 ``late_error`` when no prefill held it in time, 410 when the
        stub stops."""
        try:
            timeout = float(request.query.get("timeout", default_timeout_s))
        except ValueError:
            return json_response({"error": "bad timeout"}, 400)
        slot = self._slot(key)
        try:
            async with asyncio.timeout(timeout):
                await slot.event.wait()
        except TimeoutError:
            if self._slots.get(key) is slot and slot.held is None:
                del self._slots[key]
            return json_response({"error": late_error}, 408)
        self._slots.pop(key, None)
        if slot.held is None:  # the slot was cleared (stub stopping)
            return json_response({"error": "gone"}, 410)
        return json_response(slot.held.payload(engine_id))

    def expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, s in self._slots.items()
                    if s.held is not None and s.held.expires <= now]:
            del self._slots[key]

    def held(self) -> int:
        self.expire()
        return sum(1 for s in self._slots.values() if s.held is not None)

    def clear(self) -> None:
        self._slots.clear()


class MooncakeConnector:
    """vLLM MooncakeConnector: push model, P and D concurrent, paired by transfer_id."""

    def __init__(self, stub: Stub) -> None:
        self.stub = stub
        self.slots = HeldSlots()
        self.blocks = BlockAllocator(stub.config.block_size)
        self.pushed = 0

    def add_routes(self, app: web.Application) -> None:
        return None

    def add_bootstrap_routes(self, app: web.Application) -> None:
        app.router.add_get("/query", self._query)
        app.router.add_post("/register", self._register)
        app.router.add_get("/_stub/mooncake/{transfer_id}", self._wait_push)

    def query_body(self) -> dict[str, Any]:
        addr = f"{self.stub.config.host}:{self.stub.bootstrap_port}"
        ranks = self.stub.ranks
        ids = {str(rank): ranks.engine_id(self.stub.engine_id, rank) for rank in range(ranks.size)}
        if self.stub.config.mooncake_query_shape == "engine_id":
            # The other shape vLLM has shipped: engine id -> dp rank -> tp rank -> pp rank -> addr.
            return {engine_id: {rank: {"0": {"0": addr}}} for rank, engine_id in ids.items()}
        # One bootstrap server for every rank (vLLM 0.32.0, internal load balancing).
        return {rank: {"engine_id": engine_id, "worker_addr": {"0": {"0": addr}}}
                for rank, engine_id in ids.items()}

    async def _query(self, request: web.Request) -> web.StreamResponse:
        return json_response(self.query_body())

    async def _register(self, request: web.Request) -> web.StreamResponse:
        return json_response({"status": "ok"})

    async def _wait_push(self, request: web.Request) -> web.StreamResponse:
        transfer_id = request.match_info["transfer_id"]
        return await self.slots.wait(
            transfer_id, request, default_timeout_s=self.stub.config.waiting_timeout_s,
            engine_id=self.stub.engine_id, late_error=f"transfer {transfer_id} not pushed in time")

    def after_prefill(
        self, gen: GenRequest, request_id: str, finish: str, fault: Fault | None, rank: int
    ) -> dict[str, Any] | None:
        params = _params(gen)
        if params is None or not params.get("do_remote_decode"):
            return None
        transfer_id = params.get("transfer_id")
        if not transfer_id or finish != "length":
            return None
        if fault is not None and fault.kind is FaultKind.NO_HANDOFF:
            return None
        expires = time.monotonic() + self.stub.config.kv_lease_s
        self.slots.hold(str(transfer_id), HeldKV(
            gen.digest, [self.blocks.allocate(len(gen.prompt_ids))], len(gen.prompt_ids), expires,
            self.stub.ranks.engine_id(self.stub.engine_id, rank),
        ))
        self.pushed += 1
        return None  # MooncakeConnector.request_finished returns no params

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
        if data.get("engine_id") != engine_id:
            # The transfer was pushed by another rank than the one the decode names.
            return local("engine_mismatch")
        if data.get("prompt_digest") != f"{gen.digest:016x}":
            return local("prompt_mismatch")
        return REMOTE_OK

    def held(self) -> int:
        return self.slots.held()

    def close(self) -> None:
        self.slots.clear()


#: What a push decode's ``kv_transfer_params`` must hold (vLLM 0.32 reads each of them).
NIXL_PUSH_REQUIRED: Final = ("remote_engine_id", "remote_host", "remote_port", "tp_size",
                             "remote_request_id")
NIXL_PUSH_PREFIX: Final = "/_stub/nixl-push/"
#: Where ``VllmEngine`` puts a request's internal id for its connector (``gen.extra``).
INTERNAL_ID: Final = "internal_id"
#: vLLM's answer to a decode whose push registration handshake failed (policy "fail").
NIXL_PUSH_MISMATCH: Final = "Internal server error"


class EngineFailed(Exception):
    """A request the engine fails as vLLM fails a KV load (``kv_load_failure_policy: fail``):
    JSON: HTTP 500; streamed: HTTP 200, then an error event and ``[DONE]``."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def base_request_id(internal_id: str) -> str:
    """The id both legs share: an internal id without its ``-<8 hex>`` suffix."""
    head, sep, tail = internal_id.rpartition("-")
    if sep and len(tail) == 8 and all(c in "0123456789abcdefABCDEF" for c in tail):
        return head
    return internal_id


class NixlPushConnector:
    """vLLM NixlPushConnector (label ``nixl-push``, docs/driving/nixl-push.md): P holds the KV
    under the request's base id, D registers for it by the prefill's engine id."""

    def __init__(self, stub: Stub) -> None:
        self.stub = stub
        self.slots = HeldSlots()
        self.blocks = BlockAllocator(stub.config.block_size)
        self.pushed = 0
        self.registrations = 0
        #: Decode side: the prefill engine ids it registered with before (vLLM's agents).
        self.known_prefills: set[str] = set()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(NIXL_PUSH_PREFIX + "{base_id}", self._register)

    def add_bootstrap_routes(self, app: web.Application) -> None:
        return None

    def _engine_ids(self) -> set[str]:
        ranks = self.stub.ranks
        return {ranks.engine_id(self.stub.engine_id, rank) for rank in range(ranks.size)}

    async def _register(self, request: web.Request) -> web.StreamResponse:
        base_id = request.match_info["base_id"]
        if request.query.get("engine_id") not in self._engine_ids():
            return json_response({"error": "Remote NIXL agent engine ID mismatch"}, 409)
        self.registrations += 1
        return await self.slots.wait(
            base_id, request, default_timeout_s=self.stub.config.waiting_timeout_s,
            engine_id=self.stub.engine_id, late_error=f"request {base_id} not prefilled in time")

    def after_prefill(
        self, gen: GenRequest, request_id: str, finish: str, fault: Fault | None, rank: int
    ) -> dict[str, Any] | None:
        if not wants_nixl_prefill(_params(gen)):
            return None
        if finish != "length" or (fault is not None and fault.kind is FaultKind.NO_HANDOFF):
            return None
        engine_id = self.stub.ranks.engine_id(self.stub.engine_id, rank)
        blocks = [self.blocks.allocate(len(gen.prompt_ids))]
        self.slots.hold(base_request_id(request_id), HeldKV(
            gen.digest, blocks, len(gen.prompt_ids),
            time.monotonic() + self.stub.config.kv_lease_s, engine_id))
        self.pushed += 1
        # The keys and order of vLLM 0.32's push answer (NixlPushConnectorScheduler).
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": blocks,
            "remote_engine_id": engine_id,
            "remote_request_id": request_id,
            "remote_host": "localhost",
            "remote_port": self.stub.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": len(gen.prompt_ids),
            "transfer_mode": "push",
            "remote_prefill_cached_tokens": int(gen.extra.get("cached_tokens", 0)),
        }

    async def check_handoff(self, gen: GenRequest) -> Verdict | None:
        params = _params(gen)
        if params is None or not params.get("do_remote_prefill"):
            return None
        if any(params.get(key) is None for key in NIXL_PUSH_REQUIRED):
            return local("missing_params")
        cfg = self.stub.config
        engine_id = str(params["remote_engine_id"])
        url = (
            f"http://{params['remote_host']}:{params['remote_port']}{NIXL_PUSH_PREFIX}"
            f"{quote(base_request_id(str(gen.extra.get(INTERNAL_ID, ''))), safe='')}"
            f"?engine_id={quote(engine_id, safe='')}&timeout={cfg.waiting_timeout_s}"
        )
        try:
            status, data = await _get_json(self.stub, url, cfg.waiting_timeout_s
                                           + cfg.pull_timeout_s)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return local("pull_failed")
        if status == 409:
            if engine_id in self.known_prefills:
                # vLLM keeps a prefill engine's agent by its id: a decode naming an id it
                # handshook before notifies that (gone) agent and waits for a push that
                # never comes, instead of failing at once.
                await asyncio.sleep(cfg.waiting_timeout_s)
                return local("transfer_timeout")
            raise EngineFailed(NIXL_PUSH_MISMATCH)
        if status == 408:
            return local("transfer_timeout")
        if status != 200 or not isinstance(data, dict):
            return local("pull_failed")
        if data.get("engine_id") != engine_id:
            return local("engine_mismatch")
        if data.get("prompt_digest") != f"{gen.digest:016x}":
            return local("prompt_mismatch")
        self.known_prefills.add(engine_id)
        return REMOTE_OK

    def held(self) -> int:
        return self.slots.held()

    def close(self) -> None:
        self.slots.clear()


def make_connector(stub: Stub) -> Connector:
    name = stub.config.kv_connector
    if name == "shfs":
        return NixlConnector(stub)
    if name == "nixl":
        return NeuronConnector(stub)
    if name == "nixl-push":
        return NixlPushConnector(stub)
    return MooncakeConnector(stub)
