"""Proves ``disagg-sidecar route`` (run in-process, parsed by the real CLI parser): Prefill ->
Decode through two sidecars prints the decode engine's tokens and the finish reason (text and
JSON), a gRPC error prints the failing method and status and exits 1, and bad ``--tokens``
are refused by the parser.

Does not run the installed console script in a subprocess.
"""

from __future__ import annotations

import json

import pytest
from grpc_builders import PROMPT_IDS, expected_tokens, grpc_pd

from sidecar.__main__ import build_parser
from sidecar.tools.route import run_route_command


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
    async with grpc_pd("vllm", "shfs") as pd:
        args = build_parser().parse_args(
            ["route", "--prefill", pd.prefill.address, "--decode", pd.decode.address,
             "--tokens", "1,2", "--max-new-tokens", "0"]
        )
        assert await run_route_command(args) == 1
    assert "Decode failed: INVALID_ARGUMENT" in capsys.readouterr().err


@pytest.mark.parametrize("tokens", ["", "1,x", ","])
def test_bad_tokens_are_refused_by_the_parser(tokens: str) -> None:
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["route", "--prefill", "a:1", "--decode", "b:2",
                                   "--tokens", tokens, "--max-new-tokens", "1"])
    assert caught.value.code == 2
