"""Real vLLM engines (CPU) driven through the sidecar's HTTP front door, as a router would.

Proves, with the sidecar running as its own process (``disagg-sidecar serve``) in front of the
decode engine and the prefill engine named by ``x-prefiller-host-port``:
- NixlConnector: greedy output through the PD flow equals the baseline engine's, token for
  token, for completions and chat, JSON and streamed, prompts of several KV blocks, several
  requests at once; the KV really moved (the decode engine's NIXL bytes and external-cache
  hits grow by the prompt's size);
- ExampleConnector (no hand-off fields: the default handler's plain P-then-D flow) gives the
  baseline's output too;
- a dead prefill engine gives a 502 naming the prefill stage in bounded time, and the decode
  engine stays healthy;
- the bodies the sidecar's handlers build from a real prefill response validate against vLLM's
  own request models.

The negative control (a corrupted hand-off changes the output) is in test_engines_direct.py.
Does not prove SGLang or TensorRT-LLM against real engines (stubs cover those); Mooncake is in
test_mooncake.py.
"""

from __future__ import annotations

import contextlib
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from real_vllm.client import (
    block_prompt,
    chat_body,
    completion_body,
    metric_value,
    post_json,
    post_stream,
    text_of,
    text_of_stream,
)
from real_vllm.engine_schema import VllmSchema
from real_vllm.sidecar_process import PREFILL_HEADER, Sidecar, sidecar_process, through
from real_vllm.stack import RealVllm
from sidecar.config.settings import Settings
from sidecar.dialects import DialectSetup, dialect_class
from sidecar.protocol.context import HandoffContext, PrefillTarget, Route

ROUTES = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
HEADER = PREFILL_HEADER


@pytest.fixture(scope="module")
def nixl_sidecar(real_vllm: RealVllm, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[Sidecar]:
    yield from sidecar_process(
        tmp_path_factory.mktemp("nixl-sidecar"),
        "--engine", "vllm", "--kv-connector", "shfs", "--engine-url", real_vllm.nixl.decode,
    )


@pytest.fixture(scope="module")
def example_sidecar(real_vllm: RealVllm, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[Sidecar]:
    # ExampleConnector needs no hand-off fields: the default dialect's P-then-D flow (an
    # engine name no dialect is registered for is refused at start since issue 36).
    yield from sidecar_process(
        tmp_path_factory.mktemp("example-sidecar"),
        "--engine", "default", "--engine-url", real_vllm.example.decode,
    )


def _body(kind: str, tag: str, **extra: Any) -> dict[str, Any]:
    prompt = block_prompt(tag)
    build = completion_body if kind == "completion" else chat_body
    return build(prompt, **extra)


def _through(sidecar: Sidecar, kind: str, body: dict[str, Any], target: str) -> str:
    return through(sidecar, ROUTES[kind], body, target)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_nixl_through_the_sidecar_equals_baseline(
    real_vllm: RealVllm, nixl_sidecar: Sidecar, kind: str, stream: bool
) -> None:
    body = _body(kind, f"sidecar-{kind}-{stream}")
    expected = text_of(post_json(real_vllm.baseline + ROUTES[kind], body))
    got = _through(nixl_sidecar, kind, {**body, "stream": stream}, real_vllm.nixl.prefill_hostport)
    assert expected
    assert got == expected


def test_nixl_through_the_sidecar_moves_the_kv(
    real_vllm: RealVllm, nixl_sidecar: Sidecar
) -> None:
    body = _body("completion", "sidecar-kv-moves")
    prompt_tokens = post_json(real_vllm.baseline + ROUTES["completion"],
                              {**body, "max_tokens": 1})["usage"]["prompt_tokens"]
    decode = real_vllm.nixl.decode
    bytes_before = metric_value(decode, NIXL_BYTES)
    hits_before = metric_value(decode, EXTERNAL_HITS)
    _through(nixl_sidecar, "completion", body, real_vllm.nixl.prefill_hostport)
    assert metric_value(decode, NIXL_BYTES) > bytes_before
    # Every prompt token but the last came from the prefill engine.
    assert metric_value(decode, EXTERNAL_HITS) - hits_before >= prompt_tokens - 1


def test_several_requests_at_once_each_equal_their_baseline(
    real_vllm: RealVllm, nixl_sidecar: Sidecar
) -> None:
    bodies = [_body("completion", f"sidecar-parallel-{i}") for i in range(4)]
    expected = [text_of(post_json(real_vllm.baseline + ROUTES["completion"], b)) for b in bodies]
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        got = list(pool.map(
            lambda b: _through(nixl_sidecar, "completion", b, real_vllm.nixl.prefill_hostport),
            bodies,
        ))
    assert got == expected
    assert len(set(expected)) == len(expected)  # distinct prompts, distinct answers


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_example_connector_through_the_sidecar_equals_baseline(
    real_vllm: RealVllm, example_sidecar: Sidecar, kind: str
) -> None:
    body = _body(kind, f"sidecar-example-{kind}")
    expected = text_of(post_json(real_vllm.baseline + ROUTES[kind], body))
    hits_before = metric_value(real_vllm.example.decode, EXTERNAL_HITS)
    got = _through(example_sidecar, kind, body, real_vllm.example.prefill_hostport)
    assert got == expected
    assert metric_value(real_vllm.example.decode, EXTERNAL_HITS) > hits_before


def _closed_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_dead_prefill_gives_502_naming_the_prefill_stage(
    real_vllm: RealVllm, nixl_sidecar: Sidecar
) -> None:
    body = _body("completion", "sidecar-dead-prefill")
    request = urllib.request.Request(
        nixl_sidecar.url + ROUTES["completion"], data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", HEADER: f"127.0.0.1:{_closed_port()}"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as failure:
        urllib.request.urlopen(request, timeout=30)
    assert failure.value.code == 502
    error = json.loads(failure.value.read())["error"]
    assert (error["type"], error["code"]) == ("prefill_error", "prefill_failed")
    with urllib.request.urlopen(real_vllm.nixl.decode + "/health", timeout=10) as health:
        assert health.status == 200
    stream = post_stream(real_vllm.nixl.decode + ROUTES["completion"], {**body, "stream": True})
    assert text_of_stream(stream)


def test_sidecar_bodies_validate_against_vllm_models(
    real_vllm: RealVllm, vllm_schema: VllmSchema
) -> None:
    handler = dialect_class("vllm", "shfs")(DialectSetup(Settings()))
    items: list[Any] = []
    for kind, route in (("completion", Route.COMPLETIONS), ("chat", Route.CHAT)):
        body = _body(kind, f"sidecar-schema-{kind}", stream=True,
                     stream_options={"include_usage": True}, min_tokens=2)
        ctx = HandoffContext(route=route, request_id="schema", advertise_host="127.0.0.1",
                             prefill=PrefillTarget("127.0.0.1", real_vllm.nixl.prefill_engine.port))
        ctx = handler.begin(ctx)
        prefill = handler.prefill_body(body, ctx)
        reply = post_json(real_vllm.nixl.prefill + ROUTES[kind], prefill)
        decode = handler.decode_body(body, handler.handoff(reply, ctx))
        items += [(kind, prefill), (kind, decode)]
    assert vllm_schema.validate_many(items) == [None] * len(items)
