"""The ``cuda-graph-runner`` command: ``backends``, ``config``, ``bench``, ``inspect``.

Exit status (also in ``--help``): 0 success; 1 runtime failure (a backend named on the
command line or in the config cannot run here, a graph result disagreed with eager,
``backends --check`` found a failed or conflicting backend); 2 usage error (bad flag or
value, invalid config, unknown backend, unusable ``--device``). A user's mistake prints
one ``error:`` line and never a traceback; deprecated flags warn in one line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Any, Dict, List, Optional, Sequence

from .. import __version__
from ..backend.envs import EnvVarError
from ..backend.errors import CompileCacheError, CudaGraphRunnerError, UnknownBackendError
from ..config import CudaGraphConfigError
from .logging_setup import add_logging_arguments, configure_logging, hide_third_party_noise, level_from_args

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2

EXIT_STATUS_HELP = (
    "exit status:\n"
    "  0  success\n"
    "  1  runtime failure: a backend named on the command line or in the config cannot run here,\n"
    "     a graph result disagreed with eager, backends --check found a failed or conflicting backend\n"
    "  2  usage error: bad flag or value, invalid config, unknown backend, unusable --device"
)


class CliArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line plus a pointer to ``--help``
    (argparse's default prints the whole usage, 20+ lines for ``bench``, before the error).
    Subparsers inherit the class (argparse creates them with ``type(self)``)."""

    #: A subcommand's parser reports its own unrecognized arguments (argparse hands them
    #: up to the top parser, whose error would point at the top command's --help).
    is_subcommand = False

    def error(self, message: str) -> "Any":  # argparse's hook; exits with status 2
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\nsee '{self.prog} --help'\n")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extras = super().parse_known_args(args, namespace)
        if self.is_subcommand and extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def misplaced_flag(parser: argparse.ArgumentParser, argv: Sequence[str]) -> Optional[str]:
    """Why ``argv`` puts a flag the top command does not take before the subcommand
    (``cuda-graph-runner --cuda-graph-max-bs 4 bench``: argparse would read ``4`` as the
    command), or None."""
    commands: Dict[str, Any] = {}
    for action in parser._actions:  # argparse keeps its subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            commands = dict(action.choices)
    own = set(parser._option_string_actions)
    for i, token in enumerate(argv):
        if token in commands:
            for flag in argv[:i]:
                if flag.startswith("-") and flag.split("=", 1)[0] not in own:
                    return (
                        f"{flag} is not an option of {parser.prog} itself; a subcommand's options go after it: "
                        f"{parser.prog} {token} {flag} ..."
                    )
            return None
    return None


def _one_line_warning(message: Any, category: type, filename: str, lineno: int, line: Optional[str] = None) -> str:
    # The default format shows the interpreter's argparse path and an `action(...)` source
    # line; a command-line user needs the message only.
    return f"warning: {message}\n"


def usage_error(prog: str, message: str) -> int:
    """Print a usage error like :class:`CliArgumentParser` does; return exit status 2."""
    print(f"{prog}: error: {message}\nsee '{prog} --help'", file=sys.stderr)
    return EXIT_USAGE


def _device_type_problem(text: str, known: List[str]) -> Optional[str]:
    """Why ``text`` is not a device type (None when torch knows it)."""
    accepted = f"a torch device type without an index, such as {', '.join(known)}"
    if ":" in text:
        return f"invalid --device-type {text!r}; accepted: {accepted}"
    import torch

    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        return f"invalid --device-type {text!r}; accepted: {accepted}"
    return None


def run_backends(args: argparse.Namespace) -> int:
    """Print the installed backends (name, distribution, version, phases, status, reason),
    then who set each phase's default on the device type and who else claimed it."""
    from ..registry import PHASES, default_device_type, get_registry, list_backends, verify_all
    from .tables import format_table

    if args.device_type is not None:
        known = sorted({"cpu", "cuda"} | {d for e in list_backends() for d in e.devices if d != "*"})
        problem = _device_type_problem(args.device_type, known)
        if problem:
            return usage_error("cuda-graph-runner backends", problem)
    if args.check:
        verify_all()  # imports each backend class and records contract failures on its entry
    entries = list_backends(args.device_type)
    device_type = args.device_type or default_device_type()
    decisions = [get_registry().default_decision(phase, device_type) for phase in PHASES]
    if args.json:
        rows: list[Any] = []
        for e in entries:
            row = e.as_row()
            row["default_for"] = ",".join(d.phase for d in decisions if d.backend == e.name)
            row["claims_default_for"] = ",".join(
                d.phase for d in decisions if any(c.backend == e.name for c in d.claims)
            )
            rows.append(row)
        print(json.dumps(rows, indent=2))
    else:
        rows = [
            [
                e.name,
                e.distribution,
                e.version,
                ",".join(e.phases),
                ",".join(e.devices),
                e.status,
                e.contract,
                e.reason or "",
            ]
            for e in entries
        ]
        print(
            format_table(
                ["backend", "distribution", "version", "phases", "devices", "status", "contract", "reason"], rows
            )
        )
        print()
        for decision in decisions:
            print(decision.summary())
    return EXIT_RUNTIME if args.check and any(e.status in ("failed", "conflict") for e in entries) else EXIT_OK


def run_bench_command(args: argparse.Namespace) -> int:
    from .bench.command import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``cuda-graph-runner`` command."""
    from .bench.command import add_bench_arguments
    from .config_command import add_config_subcommand

    raw = argparse.RawDescriptionHelpFormatter
    parser = CliArgumentParser(
        prog="cuda-graph-runner",
        description="Capture an LLM's forward pass as device graphs and replay them per batch.",
        epilog=EXIT_STATUS_HELP,
        formatter_class=raw,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    add_logging_arguments(parser)
    sub = parser.add_subparsers(dest="command", required=True)

    backends = sub.add_parser(
        "backends",
        help="list installed graph backends and whether they can run here",
        epilog=EXIT_STATUS_HELP,
        formatter_class=raw,
    )
    backends.add_argument(
        "--device-type",
        default=None,
        help="probe every backend for this device type, e.g. cpu, cuda, npu (default: each backend's own device)",
    )
    backends.add_argument("--json", action="store_true", help="print JSON instead of a table")
    backends.add_argument(
        "--check",
        action="store_true",
        help="also import every backend class and check it against the contract; "
        "exit 1 if any backend is failed or in conflict",
    )
    backends.set_defaults(func=run_backends)

    add_config_subcommand(sub)

    bench = sub.add_parser(
        "bench",
        help="capture and replay the reference model; compare with eager; time both",
        epilog=EXIT_STATUS_HELP,
        formatter_class=raw,
    )
    add_bench_arguments(bench)
    bench.set_defaults(func=run_bench_command)

    from .inspect_command import add_inspect_subcommand

    add_inspect_subcommand(sub, EXIT_STATUS_HELP)
    for subcommand in sub.choices.values():  # `cuda-graph-runner bench -v` as well as `-v bench`
        add_logging_arguments(subcommand, in_subcommand=True)
        if isinstance(subcommand, CliArgumentParser):
            subcommand.is_subcommand = True
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the console script; returns the exit status (see module docstring)."""
    previous = warnings.formatwarning
    warnings.formatwarning = _one_line_warning
    hide_third_party_noise()
    try:
        parser = build_parser()
        misplaced = misplaced_flag(parser, sys.argv[1:] if argv is None else argv)
        if misplaced:
            return usage_error(parser.prog, misplaced)
        args = parser.parse_args(argv)
        configure_logging(level_from_args(args))
        from ..registry import check_environment

        check_environment()  # a bad CUDA_GRAPH_RUNNER_* value (the plugins' too) is reported before any work
        return args.func(args)
    except BrokenPipeError:  # `... | head`: the reader left; stop quietly, as cat does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except (CudaGraphConfigError, UnknownBackendError, EnvVarError, CompileCacheError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except CudaGraphRunnerError as err:  # a backend that cannot run, a broken plugin
        print(f"error: {err}", file=sys.stderr)
        return EXIT_RUNTIME
    finally:
        warnings.formatwarning = previous


if __name__ == "__main__":
    sys.exit(main())
