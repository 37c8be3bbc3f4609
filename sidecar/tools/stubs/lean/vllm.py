"""The lean engine's vLLM flavour: ``/v1/completions`` with NixlConnector hand-offs.

    prefill: kv_transfer_params.do_remote_decode ─▶ answer with a signed hand-off
             (top-level kv_transfer_params, non-streamed answers only, as vLLM)
    decode:  kv_transfer_params.do_remote_prefill ─▶ lean_nixl.Checker ─▶ verdict counted
             ─▶ remote words (lowercase) or a local recompute (UPPERCASE)

Ids as vLLM makes them: ``cmpl-<X-Request-Id or uuid hex>``. A decode counts a verdict for
every completion (``local/no_handoff`` when none came), as the aiohttp stub does.

Deliberate limits: see ``lean_engine`` and ``lean_nixl``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Final

import orjson

from bench import lean_openai
from bench.lean_client import Client, Origin
from bench.lean_http import HttpConnection, Request
from bench.lean_nixl import HANDSHAKE_PATH, Checker, Issuer, Peer, Verdict, local
from bench.lean_openai import Completion
from sidecar.stubs.openai import BadRequest
from sidecar.stubs.textgen import PrefillKind

if TYPE_CHECKING:
    from bench.lean_engine import Engine

_CHOICE_EXTRA: Final = {"prompt_token_ids": None, "token_ids": None}
_ERROR_TYPES: Final = {
    400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class VllmFlavour:
    owned_by = "vllm"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.config = engine.config
        self.prefill = self.config.role == "prefill"
        self.issuer: Issuer | None = None
        self.client = Client(timeout_s=self.config.pull_timeout_s)
        self.checker = Checker(self._handshake)

    async def start(self) -> None:
        if self.prefill:
            cfg = self.config
            self.issuer = Issuer(
                self.engine.engine_id, self.engine.port, cfg.side_channel_host, cfg.block_size
            )

    async def close(self) -> None:
        await self.client.close()

    def error_body(self, status: int, message: str) -> bytes:
        kind = _ERROR_TYPES.get(status, "BadRequestError")
        return orjson.dumps(
            {"error": {"message": message, "type": kind, "param": None, "code": status}}
        )

    def extra_route(self, request: Request, conn: HttpConnection) -> bool:
        if request.path == HANDSHAKE_PATH and request.method == b"GET" and self.issuer:
            conn.send(200, orjson.dumps(self.issuer.handshake()))
            return True
        return False

    async def _handshake(self, host: str, port: int) -> Peer:
        answer = await self.client.request(Origin(host, port), b"GET", HANDSHAKE_PATH)
        if answer.status != 200:
            raise ValueError(f"handshake answered HTTP {answer.status}")
        data = orjson.loads(answer.body)
        return Peer(str(data["engine_id"]), bytes.fromhex(data["key"]))

    def completions(
        self, request: Request, conn: HttpConnection
    ) -> Coroutine[Any, Any, None] | None:
        cfg = self.config
        try:
            c = lean_openai.parse(
                request.body, default_max_tokens=cfg.default_max_tokens,
                max_model_len=cfg.max_model_len, model=cfg.model,
            )
        except BadRequest as exc:
            conn.send(400, self.error_body(400, exc.message))
            return None
        params = c.body.get("kv_transfer_params")
        if params is not None and not isinstance(params, dict):
            conn.send(400, self.error_body(400, "kv_transfer_params must be an object or null"))
            return None
        base = request.headers.get(b"x-request-id")
        response_id = f"cmpl-{base.decode('latin-1') if base else uuid.uuid4().hex}"
        if self.prefill:
            if self.issuer is None:  # not started: no port to name in a hand-off yet
                conn.send(503, self.error_body(503, "engine starting"))
                return None
            # A prefill computes the KV a decode continues from: the "remote" words.
            handing = bool(params and params.get("do_remote_decode"))
            kv = self.issuer.issue(response_id, c.digest, c.prompt_tokens) if handing else None
            kind = PrefillKind.REMOTE if handing else PrefillKind.LOCAL
            self._answer(conn, c, response_id, kind, kv)
            return None
        verdict = self.checker.check(params, c.digest, c.prompt_tokens)
        if verdict is None:
            verdict = local("no_handoff")
        if isinstance(verdict, tuple):
            self._judged(conn, c, response_id, verdict)
            return None
        return self._judge_later(conn, c, response_id, verdict)

    async def _judge_later(
        self, conn: HttpConnection, c: Completion, response_id: str,
        pending: Coroutine[Any, Any, Verdict],
    ) -> None:
        self._judged(conn, c, response_id, await pending)

    def _judged(self, conn: HttpConnection, c: Completion, response_id: str, v: Verdict) -> None:
        self.engine.count(v)
        kind = PrefillKind.REMOTE if v[0] == "remote" else PrefillKind.LOCAL
        self._answer(conn, c, response_id, kind, None)

    def _answer(
        self, conn: HttpConnection, c: Completion, response_id: str, kind: PrefillKind,
        kv: dict[str, Any] | None,
    ) -> None:
        words = lean_openai.words(c.digest, c.max_tokens, kind)
        created = int(time.time())
        if c.stream:
            # vLLM returns kv_transfer_params on non-streamed answers only.
            conn.send_stream(
                lean_openai.render_events(c, response_id, created, words, choice_extra=b"")
            )
            return
        top = {
            "service_tier": None, "system_fingerprint": None, "kv_transfer_params": kv,
            "ec_transfer_params": None, "metrics": None,
        }
        conn.send(200, lean_openai.render_json(
            c, response_id, created, words, choice_extra=_CHOICE_EXTRA, top_extra=top
        ))
