"""Proves an engine's in-stream error event is counted as the decode failure it is, for every
engine and connector, while the stream reaches the client exactly as the engine wrote it.

vLLM (e.g. a KV load that failed because the prefill engine died after the hand-off) and
SGLang end such a stream with ``data: {"error": ...}`` and then ``data: [DONE]``; the stub
decode does the same after two events. The sidecar relays every byte (no second error event,
no cut), and counts the request as ``outcome="error"`` with ``decode_failed`` in the errors,
never as ``ok``.

Does not prove TensorRT-LLM's behaviour, which cuts its stream instead (the broken-stream rows
of test_leg_faults.py cover that).
"""

from __future__ import annotations

import json

import pytest
from fault_builders import PAIRS, client_body, engine_param, faults, rig


@pytest.mark.parametrize(("engine", "connector"), [engine_param(*pair) for pair in PAIRS])
async def test_an_engine_error_event_is_a_counted_decode_error(
    engine: str, connector: str
) -> None:
    error_event = {"kind": "error_event", "after_chunks": 2}
    async with rig(engine, connector, decode={"faults": faults(error_event)}) as r:
        reply = await r.post(stream=True)

        assert reply.status == 200 and not reply.broken
        events = reply.events()
        assert events[-1] == "[DONE]"
        errors = [json.loads(e) for e in events[:-1] if "error" in json.loads(e)]
        assert len(errors) == 1 and errors[0]["error"]["message"] == "stub fault: KV load failed"
        sidecar = r.sidecar
        assert await sidecar.metric("disagg_errors_total", front_door="http", stage="decode",
                                    code="decode_failed") == 1
        assert await sidecar.metric("disagg_requests_total", front_door="http",
                                    outcome="error") == 1
        assert await sidecar.metric("disagg_requests_total", front_door="http",
                                    outcome="ok") == 0
        await r.check_recovered()


@pytest.mark.parametrize(("engine", "connector"),
                         [engine_param("vllm", "shfs"), engine_param("sglang", "shfs")])
async def test_an_error_event_in_one_leg_of_a_fan_out_is_counted(
    engine: str, connector: str
) -> None:
    error_event = {"kind": "error_event", "after_chunks": 2, "times": 1}
    async with rig(engine, connector, decode={"faults": faults(error_event)}) as r:
        body = client_body(stream=True, n=2)
        reply = await r.post(stream=True, body=body)

        assert reply.status == 200 and not reply.broken
        events = reply.events()
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        assert sum("error" in json.loads(e) for e in events[:-1]) == 1
        sidecar = r.sidecar
        assert await sidecar.metric("disagg_errors_total", front_door="http", stage="decode",
                                    code="decode_failed") == 1
        assert await sidecar.metric("disagg_requests_total", front_door="http",
                                    outcome="error") == 1
        await r.check_recovered()
