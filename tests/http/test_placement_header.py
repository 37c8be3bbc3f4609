"""Proves the ``x-disagg-placement`` header: every answer of a PD route says where the request
ran and why, and ``--no-placement-header`` leaves it out.

Over real sockets, vLLM NIXL stub engines behind the real sidecar: a pair (JSON and streamed),
a passthrough (no prefill target), a short prompt run locally (its token count), a fanned-out
request (its sub-requests), a refusal (the error's outcome), a tokenizer that hangs (decided
within ``--tokenize-timeout-s``, not at the connect timeout). Does not prove the cache rule's
figures (tests/http/test_cache_aware_door.py) nor the header on real vLLM.
"""

from __future__ import annotations

import asyncio

from pd_builders import pd_pair

from sidecar.protocol.context import Route
from sidecar.tools.stubs.faults import Fault, FaultKind

HEADER = "x-disagg-placement"


async def test_a_pair_says_ok_json_and_streamed() -> None:
    async with pd_pair("vllm", "shfs") as pair:
        for stream in (False, True):
            status, headers, body = await pair.send(stream=stream)
            assert status == 200, body
            assert headers[HEADER] == "ok"


async def test_a_passthrough_and_a_short_prompt_say_so() -> None:
    async with pd_pair("vllm", "shfs", local_prefill_max_tokens=10_000) as pair:
        status, headers, _ = await pair.send(with_target=False)
        assert status == 200 and headers[HEADER] == "passthrough"
        status, headers, _ = await pair.send(
            body={"model": "stub-model", "prompt": [1, 2, 3, 4], "max_tokens": 2})
        assert status == 200 and headers[HEADER] == "local_short; prompt_tokens=4"


async def test_a_fanned_out_request_and_a_refusal_say_so() -> None:
    async with pd_pair("vllm", "shfs") as pair:
        status, headers, _ = await pair.send(
            body={"model": "stub-model", "prompt": "Hello", "max_tokens": 2, "n": 2})
        assert status == 200 and headers[HEADER] == "ok; sub_requests=2"
        status, headers, _ = await pair.send(headers={"x-prefiller-host-port": "10.9.9.9:1"})
        assert status == 403 and headers[HEADER] == "error"


async def test_no_placement_header_leaves_it_out() -> None:
    async with pd_pair("vllm", "shfs", placement_header=False) as pair:
        status, headers, _ = await pair.send()
        assert status == 200 and HEADER not in headers


async def test_a_hanging_tokenizer_costs_a_request_its_budget_only() -> None:
    # The local engine's tokenizer never answers: each request is decided within its
    # tokenize budget (as a prompt whose tokens are unknown: a pair), not at the 30 s
    # connect timeout, and the timeout is counted.
    hang = {"faults": [Fault(FaultKind.HANG, path="/tokenize")]}
    async with pd_pair("vllm", "shfs", decode_overrides=hang, local_prefill_max_tokens=10,
                       prompt_length_source="tokenize", tokenize_timeout_s=0.05,
                       connect_timeout_s=30.0) as pair:
        async with asyncio.timeout(20):
            for _ in range(3):
                status, headers, body = await pair.send(route=Route.COMPLETIONS)
                assert status == 200, body
                assert headers[HEADER] == "ok"
        failures = await pair.sidecar.metric("disagg_tokenize_failures_total", reason="timeout")
        assert failures == 3
