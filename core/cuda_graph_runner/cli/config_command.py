"""The ``config`` subcommand: validate the CUDA-graph flags and print the effective config.

Output (stdout) is one JSON object::

    {"config":    {"decode": {"backend": ..., "max_bs": ..., "bs": ..., "tc_compiler": ...,
                                "owned_outputs": ...},
                   "prefill": {...}},
     "sources":   {"decode": {"backend": "flag:--cuda-graph-backend-decode", ...}, ...},
     "effective": {"decode": {"backend": "disabled", "max_bs": 256, "bs": "runner buckets"}, ...},
     "backends_checked": true,
     "legend": {...}}

``config`` is what was set: ``backend: null`` means auto (the registry picks per device),
``max_bs: null`` the runner's default; ``effective`` shows what those nulls become on this
machine (the same numbers ``--help`` gives as defaults). A source of ``"default"`` means
no flag or JSON set the key. ``backends_checked`` is true when backend names (and the
backend options, such as ``tc_compiler``, each backend reads) were checked against the
installed backends; false when the registry could not be imported, in which case they
were not (a note goes to stderr). ``legend`` repeats these explanations in the output.

Exit status: 0 valid; 2 invalid config (message on stderr), the same status argparse uses
for a bad flag value.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, Collection, Dict, Mapping, Optional

from ..config import DEFAULT_MAX_BS, PHASE_KEYS, CudaGraphConfig, CudaGraphConfigError, Phase, add_cuda_graph_args

EXIT_INVALID = 2

LEGEND = {
    "config": "what was set; backend null = auto (the registry's default for the device), "
    "max_bs null = the runner's default, bs null = the runner's default buckets",
    "sources": "where each key's value came from; 'default' = nothing set it",
    "effective": "what the nulls become on this machine",
    "backends_checked": "true: backend names and backend options were checked against the installed backends; "
    "false: the registry could not be imported, so they were not checked",
    "environment": "CUDA_GRAPH_RUNNER_VERIFY, _VERIFY_FIRST_N and _VERIFY_EVERY, where set, override the verify "
    "keys of both phases when a runner is built (not shown in config/sources)",
}


def add_config_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``config`` on an argparse subparsers object; sets ``func=run_config``."""
    from .command import EXIT_STATUS_HELP

    parser = subparsers.add_parser(
        "config",
        help="validate CUDA-graph flags and print the effective config as JSON",
        description="Validate the CUDA-graph flags and print the config as JSON, with the source of each key "
        "and what each null (auto / the runner's default) becomes here ('effective'). "
        "'backends_checked' says whether backend names and options were checked against the "
        "installed backends.",
        epilog=EXIT_STATUS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_cuda_graph_args(parser)
    parser.set_defaults(func=run_config)
    return parser


def _installed_backend_phases() -> Optional[Mapping[str, Collection[str]]]:
    """The registry's ``{backend: phases}``, or None when the registry cannot be imported."""
    try:  # lazy: the registry loads plugin metadata, not needed to parse flags
        from ..registry import backend_phases
    except ImportError as err:
        print(f"note: backend names not checked: registry unavailable ({err})", file=sys.stderr)
        return None
    return backend_phases()


def _effective(config: CudaGraphConfig, checked: bool) -> Dict[str, Dict[str, Any]]:
    defaults: Dict[str, Any] = {}
    registry: Any = sys.modules.get(__package__.rpartition(".")[0] + ".registry") if checked else None
    if hasattr(registry, "get_registry"):
        device_type = registry.default_device_type()
        defaults = {phase: registry.get_registry().default_backend(phase, device_type) for phase in Phase.ALL}

    def max_bs(phase: str) -> int:
        # explicit bs: max_bs is max(bs), as in sglang (the runner captures exactly bs)
        bs = config[phase].bs
        return max(bs) if bs else config[phase].max_bs or DEFAULT_MAX_BS[phase]

    return {
        phase: {
            "backend": config[phase].backend or defaults.get(phase, "auto"),
            "max_bs": max_bs(phase),
            "bs": config[phase].bs or "the runner's buckets up to max_bs",
        }
        for phase in Phase.ALL
    }


def run_config(args: argparse.Namespace) -> int:
    """Print the effective config and each key's source; return the exit status."""
    try:
        config = CudaGraphConfig.from_args(args)
        installed = _installed_backend_phases()
        registry: Any = sys.modules.get(__package__.rpartition(".")[0] + ".registry") if installed is not None else None
        problems = getattr(registry, "backend_problems", None)
        config.validate(installed, problems() if problems else None)
        if hasattr(registry, "get_registry"):
            from ..backend import options as backend_options

            backend_options.check_with_registry(config, registry.get_registry(), registry.default_device_type())
    except CudaGraphConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INVALID
    report = {
        "config": {phase: dataclasses.asdict(config[phase]) for phase in Phase.ALL},
        "sources": {phase: {key: config.source_of(phase, key) for key in PHASE_KEYS} for phase in Phase.ALL},
        "effective": _effective(config, installed is not None),
        "backends_checked": installed is not None,
        "legend": LEGEND,
    }
    print(json.dumps(report, indent=2))
    return 0
