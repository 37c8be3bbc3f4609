"""``disagg-sidecar route``: the gRPC contract's router (docs/driving/grpc-contract.md), for humans
and tests.

    disagg-sidecar route --prefill 10.0.0.7:50051 --decode 10.0.0.8:50051 \\
        --tokens 1,2,3 --max-new-tokens 16 [--temperature 0] [--json]

    Prefill(token_ids) on --prefill ─collect blocks until done─▶
    Decode(token_ids, blocks) on --decode ─▶ prints the token ids and the finish reason

The blocks are forwarded opaquely, as the origin's router does: the route client neither reads
nor checks them. Output (stdout): the generated token ids, comma-separated, then
``finish_reason: <reason>``; with ``--json`` one object ``{"request_id", "token_ids",
"finish_reason", "blocks"}``. A gRPC error prints ``route: <method> failed: <STATUS>: <details>``
on stderr and exits 1; bad arguments exit 2.

TLS: ``--tls`` (the system's CAs), ``--tls-ca-file`` (the CA that signed the sidecars'
certificates) and, for mutual TLS, ``--tls-cert-file``/``--tls-key-file`` (the router's
client certificate); any of the files turns TLS on. ``--tls-server-name`` is the name the
certificates must carry when the address does not (default: the address's host).

Deliberate limits: one request per run, the same TLS settings for both sidecars, no
retries; proxies named in the environment are ignored (``grpc.enable_http_proxy`` off).
"""

from __future__ import annotations

import argparse
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from sidecar import jsonutil
from sidecar.grpc_gen import disagg_pb2, disagg_pb2_grpc
from sidecar.grpc_server.rpc import MAX_NEW_TOKENS

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass
class RouteResult:
    """What one Prefill -> Decode round produced."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    blocks: int = 0


class RouteError(Exception):
    """A gRPC call of the route failed."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{method} failed: {code.name}: {details}")
        self.method = method
        self.code = code
        self.details = details


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.enable_http_proxy", 0),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


@dataclass(frozen=True)
class RouteTLS:
    """TLS to the sidecars: the CA bundle to verify them (None: the system's), the router's
    client certificate and key (mutual TLS), and the name their certificates must carry."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            return None if path is None else Path(path).read_bytes()

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca_file), private_key=read(self.key_file),
            certificate_chain=read(self.cert_file),
        )


def _channel(address: str, options: list[tuple[str, Any]],
             tls: RouteTLS | None) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    if tls.server_name is not None:
        options = [*options, ("grpc.ssl_target_name_override", tls.server_name)]
    return grpc.aio.secure_channel(address, tls.credentials(), options=options)


async def route(
    prefill: str,
    decode: str,
    token_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    request_id: str | None = None,
    timeout_s: float | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    tls: RouteTLS | None = None,
) -> RouteResult:
    """Prefill on ``prefill`` (host:port), then Decode on ``decode`` with every block (over
    TLS when ``tls`` is given)."""
    result = RouteResult(request_id=request_id or uuid.uuid4().hex)
    options = channel_options(max_message_bytes)
    blocks: list[disagg_pb2.KVBlock] = []
    # The fields both requests carry, the same on both legs.
    common: dict[str, Any] = {
        "request_id": result.request_id,
        "token_ids": token_ids,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
    }
    async with _channel(prefill, options, tls) as channel:
        prefill_stub = disagg_pb2_grpc.PrefillWorkerStub(channel)
        call = prefill_stub.Prefill(disagg_pb2.PreFillRequest(**common), timeout=timeout_s)
        try:
            # Read on past `done` to the RPC's status: a trailing error is not missed.
            async for message in call:
                if message.HasField("block"):
                    blocks.append(message.block)
        except grpc.aio.AioRpcError as exc:
            raise RouteError("Prefill", exc.code(), exc.details() or "") from None
    result.blocks = len(blocks)
    async with _channel(decode, options, tls) as channel:
        decode_stub = disagg_pb2_grpc.DecodeWorkerStub(channel)
        stream = decode_stub.Decode(
            disagg_pb2.DecodeRequest(kv_blocks=blocks, **common), timeout=timeout_s
        )
        try:
            async for token in stream:
                if token.done:
                    result.finish_reason = token.finish_reason
                else:
                    result.token_ids.append(token.token_id)
        except grpc.aio.AioRpcError as exc:
            raise RouteError("Decode", exc.code(), exc.details() or "") from None
    return result


def _token_list(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--tokens must be comma-separated integers, got {text!r}"
        ) from None
    if not ids:
        raise argparse.ArgumentTypeError("--tokens must name at least one token id")
    return ids


def _max_new_tokens(text: str) -> int:
    """Decode's range, checked before the Prefill runs (it would be spent for nothing)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_NEW_TOKENS:
        raise argparse.ArgumentTypeError(
            f"--max-new-tokens must be an integer in 1..{MAX_NEW_TOKENS}, got {text!r}"
        )
    return value


def add_route_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``route`` command's flags."""
    parser.add_argument("--prefill", required=True, metavar="HOST:PORT",
                        help="gRPC address of the prefill sidecar (PrefillWorker)")
    parser.add_argument("--decode", required=True, metavar="HOST:PORT",
                        help="gRPC address of the decode sidecar (DecodeWorker)")
    parser.add_argument("--tokens", required=True, type=_token_list, metavar="IDS",
                        help="prompt token ids, comma-separated (e.g. 1,2,3)")
    parser.add_argument("--max-new-tokens", required=True, type=_max_new_tokens, metavar="N",
                        help=f"tokens to generate, 1..{MAX_NEW_TOKENS}")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature (default 0: greedy)")
    parser.add_argument("--request-id", default=None, help="request id (default: random)")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="deadline of each call (default: none)")
    parser.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES,
                        help="largest gRPC message, each direction")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    tls = parser.add_argument_group("TLS to the sidecars (any of these turns it on)")
    tls.add_argument("--tls", action="store_true",
                     help="use TLS, verified against the system's CAs (default: plaintext)")
    tls.add_argument("--tls-ca-file", metavar="PEM", default=None,
                     help="verify the sidecars' certificates against this CA bundle")
    tls.add_argument("--tls-cert-file", metavar="PEM", default=None,
                     help="mutual TLS: the router's client certificate chain (with "
                     "--tls-key-file)")
    tls.add_argument("--tls-key-file", metavar="PEM", default=None,
                     help="the private key of --tls-cert-file")
    tls.add_argument("--tls-server-name", metavar="NAME", default=None,
                     help="the name the sidecars' certificates must carry (default: the host "
                     "of --prefill and --decode)")


def tls_from_args(args: argparse.Namespace) -> RouteTLS | None:
    """The TLS settings the flags ask for, or None (plaintext)."""
    if (args.tls_cert_file is None) != (args.tls_key_file is None):
        raise ValueError("--tls-cert-file and --tls-key-file: give both or neither")
    files = (args.tls_ca_file, args.tls_cert_file, args.tls_server_name)
    if not args.tls and all(value is None for value in files):
        return None
    tls = RouteTLS(args.tls_ca_file, args.tls_cert_file, args.tls_key_file,
                   args.tls_server_name)
    for path in (tls.ca_file, tls.cert_file, tls.key_file):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{path}: no such file")
    return tls


async def run_route_command(args: argparse.Namespace) -> int:
    """Run ``route`` from parsed arguments; the process exit code."""
    try:
        tls = tls_from_args(args)
    except ValueError as exc:
        print(f"route: {exc}", file=sys.stderr)
        return 2
    try:
        result = await route(
            args.prefill,
            args.decode,
            args.tokens,
            args.max_new_tokens,
            temperature=args.temperature,
            request_id=args.request_id,
            timeout_s=args.timeout,
            max_message_bytes=args.max_message_bytes,
            tls=tls,
        )
    except RouteError as exc:
        print(f"route: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(jsonutil.dumps({
            "request_id": result.request_id,
            "token_ids": result.token_ids,
            "finish_reason": result.finish_reason,
            "blocks": result.blocks,
        }).decode())
    else:
        print(",".join(str(token) for token in result.token_ids))
        print(f"finish_reason: {result.finish_reason}")
    return 0
