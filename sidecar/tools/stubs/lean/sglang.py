"""The lean engine's SGLang flavour: ``/v1/completions`` with the bootstrap rendezvous.

    prefill (room R): lean_rooms.Board.prefill ─ a decode of R waits: hand over now
                      ─ else wait for one (bootstrap_timeout_s) ─▶ answer with 1 token
    decode  (room R): RoomClient.wait(bootstrap_host, bootstrap_port, R) (waiting_timeout_s)
                      ─▶ same prompt: remote words, verdict remote/ok; else local/prompt_mismatch

Timeouts answer 500 in SGLang's words (``... timed out after 30.0s in KVPoll.Bootstrapping``
/ ``KVPoll.WaitingForInput``). A decode without a room counts ``local/no_handoff``, one without
``bootstrap_host``/``bootstrap_port`` ``local/missing_params``, and serves locally.
The rid is the body's ``rid``, else ``X-Request-Id``, else a fresh uuid.

Deliberate limits: ``/abort_request`` answers 200 but aborts nothing (waits end by their
timeouts); see ``lean_engine`` and ``lean_rooms``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Final

import orjson

from bench import lean_openai
from bench.lean_http import HttpConnection, Request
from bench.lean_openai import Completion
from bench.lean_rooms import Board, BoardChannel, RoomClient, RoomFailed, RoomTimeout
from sidecar.stubs.openai import BadRequest
from sidecar.stubs.textgen import PrefillKind

if TYPE_CHECKING:
    from bench.lean_engine import Engine

_CHOICE_EXTRA: Final = {"matched_stop": None}


class SglangFlavour:
    owned_by = "sglang"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.config = engine.config
        self.prefill = self.config.role == "prefill"
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
        self, request: Request, conn: HttpConnection
    ) -> Coroutine[Any, Any, None] | None:
        cfg = self.config
        try:
            c = lean_openai.parse(
                request.body, default_max_tokens=cfg.default_max_tokens,
                max_model_len=cfg.max_model_len, model=cfg.model,
            )
            room = c.body.get("bootstrap_room")
            if room is not None and (isinstance(room, bool) or not isinstance(room, int)):
                raise BadRequest("bootstrap_room must be an integer")
        except BadRequest as exc:
            conn.send(400, self.error_body(400, exc.message))
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
        if room is None:
            self._judged(conn, c, rid, ("local", "no_handoff"))
            return None
        host, port = c.body.get("bootstrap_host"), c.body.get("bootstrap_port")
        if not isinstance(host, str) or not host or isinstance(port, bool) or not isinstance(
            port, int
        ):
            self._judged(conn, c, rid, ("local", "missing_params"))
            return None
        return self._decode_waits(conn, c, rid, host, port, room)

    async def _prefill_waits(
        self, conn: HttpConnection, c: Completion, rid: str, room: int,
        arrived: asyncio.Future[None],
    ) -> None:
        timeout_s = self.config.bootstrap_timeout_s
        try:
            await asyncio.wait_for(arrived, timeout_s)
        except TimeoutError:
            conn.send(500, self.error_body(500, (
                f"Prefill bootstrap failed for request rank=0 req.rid='{rid}' "
                f"req.bootstrap_room={room} with exception KVTransferError("
                f"bootstrap_room={room}): Request {room} timed out after {timeout_s}s in "
                "KVPoll.Bootstrapping"
            )))
            return
        finally:
            self.board.forget_prefill(room, arrived)
        self._answer(conn, c, rid, PrefillKind.REMOTE, 1)

    async def _decode_waits(
        self, conn: HttpConnection, c: Completion, rid: str, host: str, port: int, room: int
    ) -> None:
        timeout_s = self.config.waiting_timeout_s
        prefix = (
            f"Decode transfer failed for request rank=0 decode_req.req.rid='{rid}' "
            f"decode_req.req.bootstrap_room={room} with exception "
            f"KVTransferError(bootstrap_room={room}): "
        )
        try:
            digest, _ = await self.rooms.wait(host, port, room, timeout_s)
        except RoomTimeout:
            message = f"Request {room} timed out after {timeout_s}s in KVPoll.WaitingForInput"
            conn.send(500, self.error_body(500, prefix + message))
            return
        except RoomFailed as exc:
            message = f"Failed to fetch bootstrap info from prefill server ({exc})"
            conn.send(500, self.error_body(500, prefix + message))
            return
        verdict = ("remote", "ok") if digest == c.digest else ("local", "prompt_mismatch")
        self._judged(conn, c, rid, verdict)

    def _judged(
        self, conn: HttpConnection, c: Completion, rid: str, verdict: tuple[str, str]
    ) -> None:
        self.engine.count(verdict)
        kind = PrefillKind.REMOTE if verdict[0] == "remote" else PrefillKind.LOCAL
        self._answer(conn, c, rid, kind, c.max_tokens)

    def _answer(
        self, conn: HttpConnection, c: Completion, rid: str, kind: PrefillKind, n: int
    ) -> None:
        # SGLang's prefill server caps the prefill at one token.
        words = lean_openai.words(c.digest, min(n, c.max_tokens), kind)
        created = int(time.time())
        if c.stream:
            conn.send_stream(lean_openai.render_events(c, rid, created, words, choice_extra=b""))
            return
        conn.send(200, lean_openai.render_json(
            c, rid, created, words, choice_extra=_CHOICE_EXTRA, top_extra={}
        ))
