"""The ``cuda-graph-runner`` command: ``backends``, ``config``, ``bench``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from . import __version__


def run_backends(args: argparse.Namespace) -> int:
    """Print the installed backends (name, distribution, version, phases, status, reason)."""
    from .bench import format_table
    from .registry import list_backends, verify_all

    if args.check:
        verify_all()  # imports each backend class and records contract failures on its entry
    entries = list_backends(args.device_type)
    if args.json:
        print(json.dumps([e.as_row() for e in entries], indent=2))
        return 0
    rows = [[e.name, e.distribution, e.version, ",".join(e.phases), ",".join(e.devices), e.status,
             e.contract, e.reason or ""] for e in entries]
    print(format_table(["backend", "distribution", "version", "phases", "devices", "status", "contract", "reason"], rows))
    return 1 if args.check and any(e.status == "failed" for e in entries) else 0


def run_bench_command(args: argparse.Namespace) -> int:
    from .bench import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``cuda-graph-runner`` command."""
    from .bench import add_bench_arguments
    from .cli_config import add_config_subcommand

    parser = argparse.ArgumentParser(
        prog="cuda-graph-runner",
        description="Capture an LLM's forward pass as device graphs and replay them per batch.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    backends = sub.add_parser("backends", help="list installed graph backends and whether they can run here")
    backends.add_argument("--device-type", default=None,
                          help="probe every backend for this device type (default: each backend's own device)")
    backends.add_argument("--json", action="store_true", help="print JSON instead of a table")
    backends.add_argument("--check", action="store_true",
                          help="also import every backend class and check it against the contract; "
                               "exit 1 if any backend is failed")
    backends.set_defaults(func=run_backends)

    add_config_subcommand(sub)

    bench = sub.add_parser("bench", help="capture and replay the reference model; compare with eager; time both")
    add_bench_arguments(bench)
    bench.set_defaults(func=run_bench_command)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the console script; returns the exit status."""
    from .envs import EnvVarError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except EnvVarError as err:  # a bad CUDA_GRAPH_RUNNER_* value: the user's mistake, no traceback
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
