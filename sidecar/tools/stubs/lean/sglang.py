"""The lean transport's SGLang flavour: ``/v1/completions`` with the bootstrap rendezvous.

    prefill (room R): lean.rooms.Board.prefill ─ a decode of R waits: hand over now
                      ─ else wait for one (bootstrap_timeout_s) ─▶ answer with 1 token
    decode  (room R): handoff.sglang_decode_target ─▶ RoomClient.wait(bootstrap_host,
                      bootstrap_port, R) (waiting_timeout_s) ─▶ handoff.sglang_judge:
                      same prompt: remote words, verdict remote/ok; else local/prompt_mismatch

Timeouts answer 500 in SGLang's words (``... timed out after 30.0s in KVPoll.Bootstrapping``
/ ``KVPoll.WaitingForInput``). A decode without a room counts ``local/no_handoff``, one without
``bootstrap_host``/``bootstrap_port`` ``local/missing_params``, and serves locally.
The rid is the body's ``rid``, else ``X-Request-Id``, else a fresh uuid.

Deliberate limits: ``/abort_request`` answers 200 but aborts nothing (waits end by their
timeouts); see ``lean.server`` and ``lean.rooms``. Verdicts and wording are ``handoff``'s, as
the aiohttp transport's.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Final

import orjson

from sidecar.tools.stubs import handoff
from sidecar.tools.stubs.lean import openai as lean_openai
from sidecar.tools.stubs.lean.http import HttpConnection
from sidecar.tools.stubs.lean.keepalive import Request
from sidecar.tools.stubs.lean.openai import Completion
from sidecar.tools.stubs.lean.rooms import Board, BoardChannel, RoomClient, RoomFailed, RoomTimeout
from sidecar.tools.stubs.lean.server import FlavourBase
from sidecar.tools.stubs.textgen import PrefillKind

if TYPE_CHECKING:
    from sidecar.tools.stubs.lean.server import Engine

_CHOICE_EXTRA: Final = {"matched_stop": None}


class SglangFlavour(FlavourBase):
    owned_by = "sglang"

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.board = Board()
        self.rooms = RoomClient(connect_timeout_s=self.config.pull_timeout_s)
        self._bootstrap: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        if not self.prefill:
            return
        loop = asyncio.get_running_loop()
        self._bootstrap = await loop.create_server(
            lambda: BoardChannel(self.board), self.config.host, self.config.bootstrap_port
        )
        self.engine.bootstrap_port = int(self._bootstrap.sockets[0].getsockname()[1])

    async def close(self) -> None:
        self.rooms.close()
        if self._bootstrap is not None:
            self._bootstrap.close()

    def error_body(self, status: int, message: str) -> bytes:
        kind = "BadRequestError" if status < 500 else "InternalServerError"
        return orjson.dumps(
            {"object": "error", "message": message, "type": kind, "param": None, "code": status}
        )

    def extra_route(self, request: Request, conn: HttpConnection) -> bool:
        if request.path == "/abort_request" and request.method == b"POST":
            conn.send(200, b"")
            return True
        return False

    def completions(
        self, request: Request, c: Completion, conn: HttpConnection
    ) -> Coroutine[Any, Any, None] | None:
        try:
            room = handoff.sglang_room(c.body)
        except ValueError as exc:
            conn.send(400, self.error_body(400, str(exc)))
            return None
        rid = c.body.get("rid")
        if not isinstance(rid, str) or not rid:
            header = request.headers.get(b"x-request-id")
            rid = header.decode("latin-1") if header else uuid.uuid4().hex
        if self.prefill:
            if room is None:
                self._answer(conn, c, rid, PrefillKind.LOCAL, c.max_tokens)
                return None
            arrived = self.board.prefill(room, c.digest, c.prompt_tokens)
            if arrived is None:
                self._answer(conn, c, rid, PrefillKind.REMOTE, 1)
                return None
            return self._prefill_waits(conn, c, rid, room, arrived)
        target = handoff.sglang_decode_target(c.body, room)
        if isinstance(target, handoff.Verdict):
            self._judged(conn, c, rid, target)
            return None
        return self._decode_waits(conn, c, rid, target)

    async def _prefill_waits(
        self, conn: HttpConnection, c: Completion, rid: str, room: int,
        arrived: asyncio.Future[None],
    ) -> None:
        timeout_s = self.config.bootstrap_timeout_s
        try:
            await asyncio.wait_for(arrived, timeout_s)
        except TimeoutError:
            message = handoff.sglang_prefill_timeout(rid, room, timeout_s)
            conn.send(500, self.error_body(500, message))
            return
        finally:
            self.board.forget_prefill(room, arrived)
        self._answer(conn, c, rid, PrefillKind.REMOTE, 1)

    async def _decode_waits(
        self, conn: HttpConnection, c: Completion, rid: str, target: handoff.Rendezvous
    ) -> None:
        timeout_s = self.config.waiting_timeout_s
        room = target.room
        try:
            digest, _ = await self.rooms.wait(target.host, target.port, room, timeout_s)
        except RoomTimeout:
            message = handoff.sglang_decode_timeout(rid, room, timeout_s)
            conn.send(500, self.error_body(500, message))
            return
        except RoomFailed as exc:
            why = f"Failed to fetch bootstrap info from prefill server ({exc})"
            conn.send(500, self.error_body(500, handoff.sglang_decode_failure(rid, room, why)))
            return
        self._judged(conn, c, rid, handoff.sglang_judge(digest, c.digest))

    def _judged(
        self, conn: HttpConnection, c: Completion, rid: str, verdict: handoff.Verdict
    ) -> None:
        self.engine.count(verdict)
        self._answer(conn, c, rid, verdict.kind, c.max_tokens)

    def _answer(
        self, conn: HttpConnection, c: Completion, rid: str, kind: PrefillKind, n: int
    ) -> None:
        # SGLang's prefill server caps the prefill at one token.
        words = lean_openai.words(c.digest, min(n, c.max_tokens), kind)
        created = int(time.time())
        if c.stream:
            self.reply_stream(
                conn, lean_openai.render_events(c, rid, created, words, choice_extra=b""),
                len(words.each),
            )
            return
        self.reply(conn, lean_openai.render_json(
            c, rid, created, words, choice_extra=_CHOICE_EXTRA, top_extra={}
        ), len(words.each))
