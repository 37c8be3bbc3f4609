"""Proves the project's own tools speak TLS, so mutual TLS can be tried without other tools:

- ``stub-engine --tls-cert-file/--tls-key-file`` serves HTTPS on its engine port, and with
  ``--tls-client-ca-file`` refuses a client without a certificate of that CA; a sidecar
  with ``--engine-ca-file`` and its client certificate runs a PD request through two such
  engines (TensorRT-LLM stubs: their hand-off needs no connection between the engines);
- ``route --tls-ca-file --tls-cert-file --tls-key-file`` runs Prefill -> Decode through a
  sidecar that asks routers for client certificates; without its certificate the sidecar
  refuses it (UNAVAILABLE, exit 1), and half a pair is refused before any call (exit 2).
"""

from __future__ import annotations

import argparse
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from sidecar_builders import running_sidecar
from tls_builders import CertAuthority, client_context, tls_sidecar

from sidecar.__main__ import build_parser
from sidecar.tools.route import run_route_command
from sidecar.tools.stubs import StubConfig, run_stub
from sidecar.tools.stubs.cli import add_stub_arguments, config_from_args


@dataclass(frozen=True)
class Files:
    engines_ca: Path
    engine: tuple[Path, Path]
    sidecar_client: tuple[Path, Path]
    sidecars_ca: Path
    sidecar: tuple[Path, Path]
    routers_ca: Path
    router: tuple[Path, Path]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Files]:
    out = tmp_path_factory.mktemp("tools-tls")
    engines, sidecars, routers = (CertAuthority.create(name) for name in
                                  ("engines-ca", "sidecars-ca", "routers-ca"))
    yield Files(
        engines_ca=engines.write_cert(out),
        engine=engines.issue("engine", ips=["127.0.0.1"], server=True).write(out, "engine"),
        sidecar_client=engines.issue("sidecar", client=True).write(out, "sidecar-client"),
        sidecars_ca=sidecars.write_cert(out),
        sidecar=sidecars.issue("sidecar", ips=["127.0.0.1"], server=True).write(out, "tls"),
        routers_ca=routers.write_cert(out),
        router=routers.issue("router", client=True).write(out, "router"),
    )


def _stub(files: Files, role: str) -> StubConfig:
    return StubConfig(engine="trtllm", role=role, tls_cert_file=str(files.engine[0]),
                      tls_key_file=str(files.engine[1]),
                      tls_client_ca_file=str(files.engines_ca))


def test_the_stub_flags_build_its_tls_config() -> None:
    parser = argparse.ArgumentParser()
    add_stub_arguments(parser)
    config = config_from_args(parser.parse_args(
        ["--tls-cert-file", "c.pem", "--tls-key-file", "k.pem", "--tls-client-ca-file", "ca"]))
    assert (config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file) == (
        "c.pem", "k.pem", "ca")
    with pytest.raises(ValueError, match="both or neither"):
        config_from_args(parser.parse_args(["--tls-cert-file", "c.pem"]))


async def test_tls_stub_engines_ask_for_client_certificates_and_serve_a_pd_request(
    files: Files,
) -> None:
    async with run_stub(_stub(files, "prefill")) as prefill, \
            run_stub(_stub(files, "decode")) as decode:
        assert decode.url.startswith("https://")
        async with aiohttp.ClientSession() as session:
            with pytest.raises((aiohttp.ClientError, ssl.SSLError)):
                async with session.get(decode.url + "/health",
                                       ssl=client_context(files.engines_ca)) as response:
                    await response.read()
            async with session.get(decode.url + "/health", ssl=client_context(
                    files.engines_ca, files.sidecar_client)) as response:
                assert response.status == 200
        async with running_sidecar(
            engine="trtllm", engine_url=decode.url, engine_ca_file=str(files.engines_ca),
            engine_client_cert_file=str(files.sidecar_client[0]),
            engine_client_key_file=str(files.sidecar_client[1]),
            prefill_urls=(prefill.url,), grpc_enabled=False,
        ) as sidecar:
            async with aiohttp.ClientSession() as session:
                async with session.post(sidecar.url + "/v1/completions", json={
                        "model": "stub-model", "prompt": "hello", "max_tokens": 3}) as response:
                    assert response.status == 200, await response.text()
        assert len(prefill.recorder.on_path("/v1/completions")) == 1


async def test_route_runs_over_mutual_tls(files: Files, capsys: pytest.CaptureFixture[str]
                                          ) -> None:
    async with run_stub(StubConfig(engine="trtllm", role="both")) as engine, tls_sidecar(
        engine="trtllm", engine_url=engine.url, advertise_host="127.0.0.1",
        tls_cert_file=str(files.sidecar[0]), tls_key_file=str(files.sidecar[1]),
        tls_client_ca_file=str(files.routers_ca),
    ) as (sidecar, _):
        address = f"127.0.0.1:{sidecar.grpc_port}"
        base = ["route", "--prefill", address, "--decode", address, "--tokens", "1,2,3",
                "--max-new-tokens", "3", "--tls-ca-file", str(files.sidecars_ca)]
        mutual = [*base, "--tls-cert-file", str(files.router[0]),
                  "--tls-key-file", str(files.router[1])]
        assert await run_route_command(build_parser().parse_args(mutual)) == 0
        out = capsys.readouterr().out
        assert "finish_reason: length" in out
        assert await run_route_command(build_parser().parse_args(base)) == 1
        assert "Prefill failed: UNAVAILABLE" in capsys.readouterr().err
        half = [*base, "--tls-cert-file", str(files.router[0])]
        assert await run_route_command(build_parser().parse_args(half)) == 2
        assert "both or neither" in capsys.readouterr().err
