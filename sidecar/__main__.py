"""The composition root: ``disagg-sidecar <command>``.

    serve        run the sidecar (HTTP + gRPC front doors) next to an engine; with
                 --workers N, N processes on the same ports under one supervisor
    config       print the resolved settings (with their sources) as JSON and exit
    demo         stub engines + sidecar on loopback, one streamed PD request, exit
    stub-engine  run one stub engine (vLLM, SGLang or TensorRT-LLM; prefill or decode)
    route        a gRPC router client: Prefill on one sidecar, Decode on another

Nothing else decides what runs: this module parses the command line, builds the settings once,
and hands them to the command. A flag a subcommand does not know is answered with that
subcommand's usage and the closest flag it has (``--engin-url`` -> ``--engine-url``).
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys
from collections.abc import Callable, Sequence

from sidecar import __version__
from sidecar.config.checks import ConfigError
from sidecar.config.loader import add_settings_arguments, load_settings
from sidecar.config.report import log_effective_settings, run_config_command
from sidecar.dialects import DIALECTS
from sidecar.loop import run_async
from sidecar.observability.grpc_core_log import quiet_grpc_core
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


def _settings_command(commands: argparse._SubParsersAction[argparse.ArgumentParser], name: str,
                      help_text: str) -> argparse.ArgumentParser:
    """``serve`` or ``config``: every setting's flag, grouped, a short usage and the example."""
    from sidecar.tools.cli_help import SETTINGS_EPILOG

    command = commands.add_parser(
        name, help=help_text, description=help_text, usage="%(prog)s [FLAGS]",
        epilog=SETTINGS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_settings_arguments(command)
    return command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="disagg-sidecar",
        description="Prefill/decode-disaggregated LLM serving next to an engine ("
        f"dialects: {', '.join(DIALECTS.engines())}).",
    )
    parser.add_argument("--version", action="version", version=f"disagg-sidecar {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = _settings_command(commands, "serve", "run the sidecar next to an engine")
    serve.set_defaults(run=_serve)

    config = _settings_command(commands, "config", "print the resolved settings as JSON and exit")
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


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command: argparse.ArgumentParser = action.choices[name]
    return command


def unrecognized_message(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """``unrecognized arguments: ...``, with the closest flag ``parser`` has for each unknown
    one."""
    flags = [flag for action in parser._actions for flag in action.option_strings]
    hints = []
    for extra in extras:
        if not extra.startswith("-"):
            continue
        name = extra.split("=", 1)[0]
        close = difflib.get_close_matches(name, flags, n=1, cutoff=0.6)
        if close:
            hints.append(f"did you mean {close[0]} for {name}?")
    hint = f" ({'; '.join(hints)})" if hints else ""
    return f"unrecognized arguments: {' '.join(extras)}{hint}"


def parse_command_line(parser: argparse.ArgumentParser,
                       argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, but an unknown flag is answered by the subcommand that got it
    (its usage, the closest flag), exit status 2."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        command = getattr(args, "command", None)
        owner = _subcommand(parser, command) if command else parser
        owner.error(unrecognized_message(owner, extras))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    # Before build_parser imports grpc (the tools wing): its C core reads this once.
    quiet_grpc_core(sys.argv[1:] if argv is None else argv, os.environ)
    args = parse_command_line(build_parser(), argv)
    run: Callable[[argparse.Namespace], int] = args.run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
