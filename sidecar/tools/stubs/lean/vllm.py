"""The lean transport's vLLM flavour: ``/v1/completions`` with NixlConnector hand-offs.

    prefill: kv_transfer_params.do_remote_decode ─▶ handoff.NixlHolder.issue: blocks held
             under a lease, kv_transfer_params answered (non-streamed answers only, as vLLM)
             GET /_stub/nixl/<id> ─▶ handoff.NixlHolder.take (the decode's pull, once)
    decode:  kv_transfer_params.do_remote_prefill ─▶ handoff.nixl_pull_target ─▶ pull
             (``lean.nixl``, in the request's task) ─▶ handoff.judge_nixl_pull
             ─▶ verdict counted
             ─▶ remote words (lowercase) or a local recompute (UPPERCASE)

The same rules and verdicts as the aiohttp transport's ``vllm_connectors.NixlConnector``;
only the bytes move differently. Ids as vLLM makes them: ``cmpl-<X-Request-Id or uuid
hex>``, the internal request id ``<response id>-0-<counter>``. A decode counts a verdict for
every completion (``local/no_handoff`` when none came), as the aiohttp stub does.

Deliberate limits: see ``lean.server``.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import unquote

import orjson

from sidecar.tools.stubs import handoff
from sidecar.tools.stubs.handoff import PullTarget, Verdict
from sidecar.tools.stubs.lean import openai as lean_openai
from sidecar.tools.stubs.lean.http import HttpConnection
from sidecar.tools.stubs.lean.keepalive import Request
from sidecar.tools.stubs.lean.nixl import Puller
from sidecar.tools.stubs.lean.openai import Completion
from sidecar.tools.stubs.lean.server import FlavourBase
from sidecar.tools.stubs.textgen import PrefillKind

if TYPE_CHECKING:
    from sidecar.tools.stubs.lean.server import Engine

_CHOICE_EXTRA: Final = {"prompt_token_ids": None, "token_ids": None}
_ERROR_TYPES: Final = {
    400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
    503: "ServiceUnavailableError",
}
_NO_HANDOFF: Final = handoff.local("no_handoff")


class VllmFlavour(FlavourBase):
    owned_by = "vllm"

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.holder = handoff.NixlHolder(self.config, engine.engine_id)
        self.puller: Puller | None = None
        self._ids = itertools.count(1)

    async def start(self) -> None:
        return None

    def _puller(self) -> Puller:
        # Made on the first pull: its connection pool belongs to the running loop.
        if self.puller is None:
            self.puller = Puller(self.config.pull_timeout_s)
        return self.puller

    async def close(self) -> None:
        self.holder.clear()
        if self.puller is not None:
            await self.puller.close()

    def error_body(self, status: int, message: str) -> bytes:
        kind = _ERROR_TYPES.get(status, "BadRequestError")
        return orjson.dumps(
            {"error": {"message": message, "type": kind, "param": None, "code": status}}
        )

    def extra_route(self, request: Request, conn: HttpConnection) -> bool:
        path = request.path
        if self.prefill and request.method == b"GET" and path.startswith(handoff.NIXL_PULL_PREFIX):
            payload = self.holder.take(unquote(path[len(handoff.NIXL_PULL_PREFIX):]))
            if payload is None:
                conn.send(404, b'{"error":"unknown or expired request"}')
            else:
                conn.send(200, orjson.dumps(payload))
            return True
        return False

    def completions(
        self, request: Request, c: Completion, conn: HttpConnection
    ) -> Coroutine[Any, Any, None] | None:
        params = c.body.get("kv_transfer_params")
        if params is not None and not isinstance(params, dict):
            conn.send(400, self.error_body(400, "kv_transfer_params must be an object or null"))
            return None
        base = request.headers.get(b"x-request-id")
        response_id = f"cmpl-{base.decode('latin-1') if base else uuid.uuid4().hex}"
        if self.prefill:
            # A prefill computes the KV a decode continues from: the "remote" words.
            kv = None
            kind = PrefillKind.LOCAL
            if handoff.wants_nixl_prefill(params):
                internal_id = f"{response_id}-0-{next(self._ids):08x}"
                kv = self.holder.issue(internal_id, c.digest, c.prompt_tokens, self.engine.port)
                kind = PrefillKind.REMOTE
            self._answer(conn, c, response_id, kind, kv)
            return None
        target = handoff.nixl_pull_target(params, c.prompt_tokens, self.config.block_size)
        if target is None:
            self._judged(conn, c, response_id, _NO_HANDOFF)
            return None
        if isinstance(target, Verdict):
            self._judged(conn, c, response_id, target)
            return None
        return self._pull_then_answer(conn, c, response_id, target)

    async def _pull_then_answer(
        self, conn: HttpConnection, c: Completion, response_id: str, target: PullTarget
    ) -> None:
        answer = await self._puller().pull(target)
        verdict = handoff.local("pull_failed") if answer is None else handoff.judge_nixl_pull(
            target, answer[0], answer[1], c.digest
        )
        self._judged(conn, c, response_id, verdict)

    def _judged(self, conn: HttpConnection, c: Completion, response_id: str, v: Verdict) -> None:
        self.engine.count(v)
        self._answer(conn, c, response_id, v.kind, None)

    def _answer(
        self, conn: HttpConnection, c: Completion, response_id: str, kind: PrefillKind,
        kv: dict[str, Any] | None,
    ) -> None:
        words = lean_openai.words(c.digest, c.max_tokens, kind)
        created = int(time.time())
        if c.stream:
            # vLLM returns kv_transfer_params on non-streamed answers only.
            self.reply_stream(
                conn, lean_openai.render_events(c, response_id, created, words,
                                                choice_extra=b"", token_ids=True),
                len(words.each),
            )
            return
        top = {
            "service_tier": None, "system_fingerprint": None, "kv_transfer_params": kv,
            "ec_transfer_params": None, "metrics": None,
        }
        self.reply(conn, lean_openai.render_json(
            c, response_id, created, words, choice_extra=_CHOICE_EXTRA, top_extra=top
        ), len(words.each))
