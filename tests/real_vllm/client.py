"""Small synchronous HTTP helpers for talking to real engines on loopback from tests.

Owns: POSTing OpenAI bodies (JSON or SSE-streamed), collecting a stream's text, reading a
Prometheus metric from ``/metrics``, and building the NIXL and Mooncake prefill/decode bodies
the way the vLLM docs and examples describe (the reference the sidecar's own builders are
compared against).

Deliberate limits: blocking ``urllib`` only (tests call engines one request at a time, and
the sidecar's venv needs nothing extra); no retries; bodies are plain dicts.
"""

from __future__ import annotations

import copy
import json
import re
import time
import urllib.error
import urllib.request
from typing import Any

from protocol_builders import nixl_prefill_skeleton

TIMEOUT_S = 60.0


class EngineHTTPError(RuntimeError):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


def _request(url: str, body: dict[str, Any]) -> urllib.request.Request:
    return urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )


def post_json(url: str, body: dict[str, Any], timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """POST a JSON body, return the decoded JSON reply; non-2xx raises EngineHTTPError."""
    try:
        with urllib.request.urlopen(_request(url, body), timeout=timeout) as resp:
            reply: dict[str, Any] = json.loads(resp.read())
            return reply
    except urllib.error.HTTPError as exc:
        raise EngineHTTPError(exc.code, exc.read().decode(errors="replace")) from exc


def post_stream(url: str, body: dict[str, Any], timeout: float = TIMEOUT_S) -> list[dict[str, Any]]:
    """POST a streaming body, return the decoded ``data:`` events up to ``[DONE]``."""
    events: list[dict[str, Any]] = []
    try:
        with urllib.request.urlopen(_request(url, body), timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return events
                events.append(json.loads(data))
    except urllib.error.HTTPError as exc:
        raise EngineHTTPError(exc.code, exc.read().decode(errors="replace")) from exc
    raise AssertionError("stream ended without [DONE]")


def text_of(reply: dict[str, Any]) -> str:
    """The generated text of a non-streamed completion or chat reply (first choice)."""
    choice = reply["choices"][0]
    if "message" in choice:
        return str(choice["message"]["content"] or "")
    return str(choice["text"])


def text_of_stream(events: list[dict[str, Any]]) -> str:
    """The generated text of a completion or chat stream, joined over its chunks."""
    parts: list[str] = []
    for event in events:
        for choice in event.get("choices", []):
            if "delta" in choice:
                parts.append(choice["delta"].get("content") or "")
            else:
                parts.append(choice.get("text") or "")
    return "".join(parts)


def get_text(url: str, timeout: float = TIMEOUT_S) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return str(resp.read().decode())


_SAMPLE = re.compile(
    r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)"
)


def metric_value(engine_url: str, name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` on an engine's /metrics whose labels include
    ``labels``; 0.0 when there is none (a counter not yet created reads as zero).

    ``name`` is the full sample name, e.g. ``vllm:nixl_bytes_transferred_sum`` or
    ``vllm:external_prefix_cache_hits_total``.
    """
    total = 0.0
    for line in get_text(f"{engine_url}/metrics").splitlines():
        match = _SAMPLE.match(line)
        if match is None or match["name"] != name:
            continue
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match["labels"] or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(match["value"])
    return total


def timed_out(error: BaseException) -> bool:
    """Whether a urllib call failed by its own timeout (raised bare while reading, wrapped
    in URLError while connecting)."""
    return isinstance(error, TimeoutError) or (
        isinstance(error, urllib.error.URLError) and isinstance(error.reason, TimeoutError))


#: How often ``metric_rises`` asks an engine (its stats are published between steps).
METRIC_POLL_S = 0.25


def metric_rises(engine_url: str, name: str, above: float, deadline_s: float = 60.0,
                 **labels: str) -> float:
    """``metric_value`` once it is above ``above`` (raises AssertionError after
    ``deadline_s``): an engine publishes a transfer's figures with its next step's stats,
    after the request that caused it has answered, and no event says when."""
    deadline = time.monotonic() + deadline_s
    while True:
        value = metric_value(engine_url, name, **labels)
        if value > above:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} on {engine_url} still {value} after {deadline_s} s")
        time.sleep(METRIC_POLL_S)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The NIXL prefill leg of ``body``: one token, not streamed, asking for remote decode."""
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    out.pop("max_completion_tokens", None)
    out.pop("min_tokens", None)
    out["stream"] = False
    out.pop("stream_options", None)
    out["kv_transfer_params"] = nixl_prefill_skeleton()
    return out


def decode_body(
    body: dict[str, Any], prefill_reply: dict[str, Any], remote_host: str = "127.0.0.1"
) -> dict[str, Any]:
    """The NIXL decode leg: the original body plus the prefill's params, host replaced."""
    params = prefill_reply.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise AssertionError(f"prefill reply has no kv_transfer_params: {prefill_reply}")
    out = copy.deepcopy(body)
    out["kv_transfer_params"] = {**params, "remote_host": remote_host}
    return out


def mooncake_prefill_body(body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """The Mooncake prefill leg (vLLM's Mooncake proxy example): one token, not streamed,
    pushing its KV to whichever decode asks for ``transfer_id``."""
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    out.pop("max_completion_tokens", None)
    out.pop("min_tokens", None)
    out["stream"] = False
    out.pop("stream_options", None)
    out["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": transfer_id,
    }
    return out


def mooncake_decode_body(
    body: dict[str, Any], transfer_id: str, bootstrap_addr: str, engine_id: str
) -> dict[str, Any]:
    """The Mooncake decode leg: the original body asking ``engine_id`` (found through the
    bootstrap server at ``bootstrap_addr``, ``http://host:port``) for ``transfer_id``."""
    out = copy.deepcopy(body)
    out["kv_transfer_params"] = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "remote_bootstrap_addr": bootstrap_addr,
        "remote_engine_id": engine_id,
    }
    return out


def block_prompt(tag: str, items: int = 12) -> str:
    """A deterministic text prompt of several 32-token blocks (about 12 tokens per item).

    ``tag`` leads the prompt so that different tests never share a cached prefix.
    """
    lines = [f"# {tag}", "def fibonacci(n):"]
    lines += [f"    value_{i} = compute(x, {i})" for i in range(items)]
    return "\n".join(lines)


def completion_body(prompt: str, max_tokens: int = 12, **extra: Any) -> dict[str, Any]:
    """A greedy completion body for the tiny model (``ignore_eos``: it may emit EOS early)."""
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    body.update(extra)
    return body


def chat_body(prompt: str, max_tokens: int = 12, **extra: Any) -> dict[str, Any]:
    """A greedy chat body with one user message."""
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    body.update(extra)
    return body


def post_stream_raw(url: str, body: dict[str, Any], timeout: float = TIMEOUT_S) -> str:
    """POST a streaming body and return the SSE body exactly as the engine sent it."""
    try:
        with urllib.request.urlopen(_request(url, body), timeout=timeout) as resp:
            return str(resp.read().decode())
    except urllib.error.HTTPError as exc:
        raise EngineHTTPError(exc.code, exc.read().decode(errors="replace")) from exc
