"""Proves ``disagg-sidecar route`` (run in-process, parsed by the real CLI parser): Prefill ->
Decode through two sidecars prints the decode engine's tokens and the finish reason (text and
JSON), a gRPC error prints the failing method and status and exits 1, and bad ``--tokens``
and a ``--max-new-tokens`` out of Decode's range are refused by the parser (before any call).

Does not run the installed console script in a subprocess.
"""

from __future__ import annotations

import json

import pytest
from grpc_builders import PROMPT_IDS, expected_tokens, grpc_pd

from sidecar.__main__ import build_parser
from sidecar.grpc_server.rpc import MAX_NEW_TOKENS
from sidecar.tools.route import run_route_command
from sidecar.tools.stubs.faults import Fault, FaultKind


def _args(prefill: str, decode: str, *extra: str) -> list[str]:
    tokens = ",".join(str(t) for t in PROMPT_IDS)
    return ["route", "--prefill", prefill, "--decode", decode, "--tokens", tokens,
            "--max-new-tokens", "5", *extra]


async def test_route_prints_the_decode_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    async with grpc_pd("vllm", "shfs") as pd:
        args = build_parser().parse_args(_args(pd.prefill.address, pd.decode.address))
        assert await run_route_command(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [",".join(str(t) for t in expected_tokens(PROMPT_IDS, 5)),
                     "finish_reason: length"]


async def test_route_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    async with grpc_pd("trtllm") as pd:
        args = build_parser().parse_args(
            _args(pd.prefill.address, pd.decode.address, "--json", "--request-id", "cli-1",
                  "--timeout", "30")
        )
        assert await run_route_command(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result == {"request_id": "cli-1", "token_ids": expected_tokens(PROMPT_IDS, 5),
                      "finish_reason": "length", "blocks": 1}


async def test_route_reports_grpc_errors(capsys: pytest.CaptureFixture[str]) -> None:
    fault = Fault(FaultKind.STATUS, status=400, path="/v1/completions")
    async with grpc_pd("vllm", "shfs", decode_stub={"faults": (fault,)}) as pd:
        args = build_parser().parse_args(_args(pd.prefill.address, pd.decode.address))
        assert await run_route_command(args) == 1
    assert "Decode failed: INVALID_ARGUMENT" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", str(MAX_NEW_TOKENS + 1), "many"])
def test_max_new_tokens_out_of_range_is_refused_before_any_call(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Decode takes 1..2**20: a route that ran the Prefill first would spend it for nothing.
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["route", "--prefill", "a:1", "--decode", "b:2",
                                   "--tokens", "1,2", "--max-new-tokens", value])
    assert caught.value.code == 2
    assert f"--max-new-tokens must be an integer in 1..{MAX_NEW_TOKENS}" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("tokens", ["", "1,x", ","])
def test_bad_tokens_are_refused_by_the_parser(tokens: str) -> None:
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["route", "--prefill", "a:1", "--decode", "b:2",
                                   "--tokens", tokens, "--max-new-tokens", "1"])
    assert caught.value.code == 2
