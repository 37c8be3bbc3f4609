"""Proves the NIXL push hand-off through the gRPC door's native Prefill/Decode (stub engines).

The prefill-role sidecar learns its own engine's identity from the first Prefill (which runs
the engine call before answering); from the second on, Prefill streams the hand-off before its
engine answers (the engine call runs on in the background, watched), so a router's Decode
reaches the decode engine while the prefill is still computing, and the decode still finds the
KV (the stub's decode waits for it, as vLLM's push decode does). Both legs carry the router's
request id. An operator-given identity (``--nixl-push-engine-id``) makes even the first
Prefill answer at once.

Does not prove: real vLLM behind the gRPC door (tests/real_vllm/test_nixl_push.py covers the
HTTP door only).
"""

from __future__ import annotations

import asyncio

from grpc_builders import PROMPT_IDS, expected_tokens, grpc_pd, grpc_sidecar, prefill_blocks
from sidecar_builders import engine_settings, stub_pair

from sidecar.tools.route import route
from sidecar.tools.stubs.server import Stub

MAX_NEW_TOKENS = 6
PREFILL_DELAY_S = 3.0


def prefilled(stub: Stub) -> int:
    """How many prefills the stub engine has finished (its push connector's count)."""
    return int(getattr(stub.engine, "connector").pushed)  # noqa: B009 - the vLLM flavour's


async def test_second_prefill_hands_off_before_its_engine_answers() -> None:
    async with grpc_pd("vllm", "nixl-push") as pd:
        first = await route(pd.prefill.address, pd.decode.address, PROMPT_IDS, MAX_NEW_TOKENS,
                            request_id="push-1")
        assert first.token_ids == expected_tokens(PROMPT_IDS, MAX_NEW_TOKENS)
        assert prefilled(pd.prefill_stub) == 1

        pd.prefill_stub.faults.add("delay", path="/v1/completions", delay_s=PREFILL_DELAY_S,
                                   times=1)
        blocks = await prefill_blocks(pd.prefill.address, PROMPT_IDS, request_id="push-2")
        assert blocks  # the hand-off came back ...
        assert prefilled(pd.prefill_stub) == 1  # ... before the engine answered
        second = await route(pd.prefill.address, pd.decode.address, PROMPT_IDS,
                             MAX_NEW_TOKENS, request_id="push-3")
        assert second.token_ids == expected_tokens(PROMPT_IDS, MAX_NEW_TOKENS)
        seen = pd.decode_stub.recorder.on_path("/v1/completions")
        assert [r.headers["X-Request-Id"] for r in seen] == ["push-1", "push-3"]
        assert seen[-1].json["kv_transfer_params"]["remote_request_id"] == "push-3"
        assert [d.reason for d in pd.decode_stub.recorder.decisions] == ["ok", "ok"]
        assert await pd.prefill.runtime.admission.wait_idle(10.0)


async def test_an_operator_given_identity_answers_the_first_prefill_at_once() -> None:
    async with stub_pair("vllm", "nixl-push") as (p_stub, d_stub):
        p_stub.engine_id = "op-given"
        common = engine_settings("vllm", "nixl-push", p_stub)
        async with (
            grpc_sidecar(p_stub.url, role="prefill", nixl_push_engine_id="op-given",
                         nixl_push_side_channel_port=p_stub.port, **common) as prefill,
            grpc_sidecar(d_stub.url, role="decode", **common) as decode,
        ):
            p_stub.faults.add("delay", path="/v1/completions", delay_s=PREFILL_DELAY_S,
                              times=1)
            routed = asyncio.ensure_future(route(prefill.address, decode.address, PROMPT_IDS,
                                                 MAX_NEW_TOKENS, request_id="op-1"))
            seen = await d_stub.recorder.next_request("/v1/completions")
            assert prefilled(p_stub) == 0  # the decode is there before the prefill
            assert seen.json["kv_transfer_params"]["remote_engine_id"] == "op-given"
            result = await routed
            assert result.token_ids == expected_tokens(PROMPT_IDS, MAX_NEW_TOKENS)
            assert [d.reason for d in d_stub.recorder.decisions] == ["ok"]
