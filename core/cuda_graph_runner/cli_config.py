"""The ``config`` subcommand: validate the CUDA-graph flags and print the effective config.

Output (stdout) is one JSON object::

    {"config":  {"decode": {"backend": ..., "max_bs": ..., "bs": ..., "tc_compiler": ..., "owned_outputs": ...},
                 "prefill": {...}},
     "sources": {"decode": {"backend": "flag:--cuda-graph-backend-decode", ...}, ...},
     "backends_checked": true}

``backend: null`` means auto (the registry picks per device); a source of
``"default"`` means no flag or JSON set the key. ``backends_checked`` is false
when the registry could not be imported, in which case backend names are not
checked against the installed backends (a note goes to stderr).

Exit status: 0 valid; 2 invalid config (message on stderr), the same status
argparse uses for a bad flag value.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, Collection, Dict, Optional

from .config import PHASE_KEYS, CudaGraphConfig, CudaGraphConfigError, Phase, add_cuda_graph_args

EXIT_INVALID = 2


def add_config_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``config`` on an argparse subparsers object; sets ``func=run_config``."""
    parser = subparsers.add_parser(
        "config",
        help="validate CUDA-graph flags and print the effective config as JSON",
        description="Validate the CUDA-graph flags and print the effective config as JSON, with the source "
                    "of each key. null means: auto (backend) or the runner's default (sizes).",
    )
    add_cuda_graph_args(parser)
    parser.set_defaults(func=run_config)
    return parser


def _installed_backend_phases() -> Optional[Dict[str, Collection[str]]]:
    """The registry's ``{backend: phases}``, or None when the registry cannot be imported."""
    try:  # lazy: the registry loads plugin metadata, not needed to parse flags
        from .registry import backend_phases
    except ImportError as err:
        print(f"note: backend names not checked: registry unavailable ({err})", file=sys.stderr)
        return None
    return backend_phases()


def run_config(args: argparse.Namespace) -> int:
    """Print the effective config and each key's source; return the exit status."""
    try:
        config = CudaGraphConfig.from_args(args)
        installed = _installed_backend_phases()
        config.validate(installed)
    except CudaGraphConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INVALID
    report = {
        "config": {phase: dataclasses.asdict(config[phase]) for phase in Phase.ALL},
        "sources": {phase: {key: config.source_of(phase, key) for key in PHASE_KEYS} for phase in Phase.ALL},
        "backends_checked": installed is not None,
    }
    print(json.dumps(report, indent=2))
    return 0
