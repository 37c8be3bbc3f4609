"""Proves the gRPC door's request ids follow the HTTP door's rule as a whole-string match:
an id ending in a line feed (which ``^...$`` let through: ``$`` matches before a final
newline) is replaced by a fresh id on the engine legs and in the hand-off, and the RPC
succeeds; the sane id of the same shape is kept. Does not prove what a log reader does with
the fresh id (the log names ``-`` for an id it refused)."""

from __future__ import annotations

import uuid

from grpc_builders import PROMPT_IDS, grpc_pd, prefill_blocks

from sidecar.grpc_server.native import decode_handoff
from sidecar.protocol.request import REQUEST_ID_HEADER


async def test_a_request_id_ending_in_a_line_feed_is_replaced_not_forwarded() -> None:
    async with grpc_pd("vllm", "nixl") as pd:
        blocks = await prefill_blocks(pd.prefill.address, PROMPT_IDS, request_id="req-1\n")
        handoff = decode_handoff(blocks)
        assert handoff.request_id != "req-1\n"
        assert uuid.UUID(hex=handoff.request_id).version == 4
        got = await pd.prefill_stub.recorder.next_request("/v1/completions")
        assert got.headers[REQUEST_ID_HEADER] == handoff.request_id
        blocks = await prefill_blocks(pd.prefill.address, PROMPT_IDS, request_id="req-1")
        assert decode_handoff(blocks).request_id == "req-1"
