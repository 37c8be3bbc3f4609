"""The composition root: ``disagg-sidecar <command>``.

    serve        run the sidecar (HTTP + gRPC front doors) next to an engine; with
                 --workers N, N processes on the same ports under one supervisor
    config       print the resolved settings (with their sources) as JSON and exit
    demo         stub engines + sidecar on loopback, one streamed PD request, exit
    stub-engine  run one stub engine (vLLM, SGLang or TensorRT-LLM; prefill or decode)
    route        a gRPC router client: Prefill on one sidecar, Decode on another

Nothing else decides what runs: this module parses the command line, builds the settings once,
and hands them to the command.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

from sidecar import __version__
from sidecar.config.checks import ConfigError
from sidecar.config.loader import (
    add_settings_arguments,
    load_settings,
    log_effective_settings,
    run_config_command,
)
from sidecar.dialects import DIALECTS
from sidecar.loop import run_async
from sidecar.observability.logs import configure_logging

logger = logging.getLogger("sidecar")


def _serve(args: argparse.Namespace) -> int:
    try:
        loaded = load_settings(args, os.environ)
    except ConfigError as exc:
        print(f"disagg-sidecar: invalid configuration: {exc}", file=sys.stderr)
        return 2
    configure_logging(loaded.settings.log_level, loaded.settings.log_format)
    log_effective_settings(loaded, logger)
    from sidecar.workers.ports import PortInUse

    try:
        if loaded.settings.workers > 1:
            from sidecar.workers.supervisor import supervise

            return run_async(supervise(loaded.settings))
        from sidecar.serve import serve_until_signalled

        return run_async(serve_until_signalled(loaded.settings))
    except PortInUse as exc:
        print(f"disagg-sidecar: cannot listen: {exc}", file=sys.stderr)
        return 2


def _demo(args: argparse.Namespace) -> int:
    from sidecar.tools.demo import run_demo

    return run_async(run_demo(args))


def _stub(args: argparse.Namespace) -> int:
    from sidecar.tools.stubs.cli import run_stub_command

    configure_logging("info", "text")
    return run_async(run_stub_command(args))


def _route(args: argparse.Namespace) -> int:
    from sidecar.tools.route import run_route_command

    return run_async(run_route_command(args))


#: A subcommand: the parsed command line in, the exit status out.
Command = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="disagg-sidecar",
        description="Prefill/decode-disaggregated LLM serving next to an engine ("
        f"dialects: {', '.join(DIALECTS.engines())}).",
    )
    parser.add_argument("--version", action="version", version=f"disagg-sidecar {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the sidecar next to an engine")
    add_settings_arguments(serve)
    serve.set_defaults(run=_serve)

    config = commands.add_parser("config", help="print the resolved settings as JSON and exit")
    add_settings_arguments(config)
    config.set_defaults(run=run_config_command)

    # The tools wing, loaded only here; a broken grpcio install fails loudly (route needs it).
    from sidecar.tools.demo import add_demo_arguments
    from sidecar.tools.route import add_route_arguments
    from sidecar.tools.stubs.cli import add_stub_arguments

    tools: tuple[tuple[str, str, Callable[[argparse.ArgumentParser], None], Command], ...] = (
        ("demo", "run stub engines and the sidecar on loopback, send one PD request, exit",
         add_demo_arguments, _demo),
        ("stub-engine", "run a stub engine (for tests and demos)", add_stub_arguments, _stub),
        ("route", "gRPC router client: Prefill on one sidecar, Decode on another",
         add_route_arguments, _route),
    )
    for name, help_text, add_arguments, run in tools:
        tool = commands.add_parser(name, help=help_text)
        add_arguments(tool)
        tool.set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
