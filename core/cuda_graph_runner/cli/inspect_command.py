"""cuda-graph-runner inspect: capture as bench would and list what was captured.

It takes the bench's model, size, backend and config flags
(:func:`cuda_graph_runner.cli.bench.args.add_model_arguments` and the config flags), loads
the model, builds one runner per phase and backend, captures, and prints each runner's
``describe()`` (:meth:`cuda_graph_runner.runner.base.BaseCudaGraphRunner.describe`): per
captured key the capture seconds and the backend's facts (CUDA graph nodes and kernels;
a breakable graph's segments and the marked ops between them), per runner the capture
seconds and the graph memory. ``--json`` prints the list of ``describe()`` documents
instead of the tables. Nothing is replayed, so replays and fallbacks read 0.

Graphs are captured with their templates kept (``keep_graph_templates``), so node counts
are known where torch can tell (:mod:`cuda_graph_runner.backend.graph_nodes`). Exit status as
the other commands: 0, 1 (a backend named explicitly cannot run here), 2 (usage errors:
a bad flag or value, an invalid config, an unknown backend or model, an unusable
``--device``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Dict, List

from ..config import add_cuda_graph_args
from .bench.args import add_model_arguments

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2

#: The columns of a runner's table, and the describe() field of each.
COLUMNS = (
    ("key", "key"),
    ("capture s", "capture_seconds"),
    ("nodes", "nodes"),
    ("kernels", "kernels"),
    ("segments", "segments"),
    ("ops between", "ops_between"),
    ("replays", "replays_of_size"),
)


def add_inspect_subcommand(sub: Any, epilog: str) -> None:
    """Register ``inspect`` on the ``cuda-graph-runner`` subparsers."""
    parser = sub.add_parser(
        "inspect",
        help="capture the reference model as bench does and list each runner's graphs (runner.describe())",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(parser, measured=False)
    parser.add_argument("--no-prefill", action="store_true", help="skip the prefill runners")
    parser.add_argument("--json", action="store_true", help="print the describe() documents as JSON")
    add_cuda_graph_args(parser)
    parser.set_defaults(func=run_inspect)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list):
        return ",".join(map(str, value)) or "-"
    return str(value)


def format_description(doc: Dict[str, Any]) -> str:
    """One runner's ``describe()`` as a header line and a table of its graphs."""
    from .tables import format_table

    memory = doc.get("graph_memory_bytes")
    seconds = doc.get("capture_seconds")
    header = (
        f"{doc['phase']}, backend {doc['backend']}"
        + (" (eager-through: replays run the forward eagerly)" if doc["mode"] == "eager_through" else "")
        + f": {len(doc['graphs'])} graph{'' if len(doc['graphs']) == 1 else 's'}"
        + (f" in {seconds:.2f} s" if seconds is not None else "")
        + (f" (compile {doc['compile_seconds']:.2f} s)" if doc.get("compile_seconds") is not None else "")
        + f", graph memory {'-' if memory is None else f'{memory / 2**20:.1f} MiB'}"
        + f", {doc['replays']} replays, {doc['eager_total']} eager"
    )
    fallbacks = doc.get("eager_fallbacks") or {}
    if fallbacks:
        header += " (" + ", ".join(f"{reason} {n}" for reason, n in fallbacks.items()) + ")"
    if not doc["graphs"]:
        return header
    rows = [[_cell(g.get(field)) for _, field in COLUMNS] for g in doc["graphs"]]
    return header + "\n" + format_table([name for name, _ in COLUMNS], rows)


def run_inspect(args: argparse.Namespace) -> int:
    """Capture per phase and backend, print each runner's ``describe()``; returns the
    exit status (module docstring)."""
    import torch

    from ..config import CudaGraphConfig, CudaGraphConfigError
    from ..reference.models.hf import TransformersUnavailableError
    from ..reference.real_model import RealModelUnavailableError
    from .bench.args import DTYPES
    from .bench.backends import BenchRequestError, device_problem, plan_phase
    from .bench.command import _make_runner, load_model

    def fail(message: str, code: int = EXIT_USAGE) -> int:
        print(f"error: {message}", file=sys.stderr)
        return code

    try:
        config = CudaGraphConfig.from_args(args)
    except CudaGraphConfigError as exc:
        return fail(str(exc))
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, ValueError) as exc:
        return fail(
            f"--device {args.device!r} is not a torch device ({str(exc).splitlines()[0]}); "
            "accepted: cpu, cuda, cuda:N, npu:N, ..."
        )
    problem = device_problem(device)
    if problem:
        return fail(f"--device {args.device!r}: {problem}")
    on_cpu = device.type == "cpu"
    dtype = DTYPES[args.dtype or ("float32" if on_cpu else "bfloat16")]
    model_spec = args.model or ("tiny" if on_cpu else "llama-3.2-1b")
    max_bs = max(args.batch_sizes or ([1, 2, 4] if on_cpu else [1, 4, 16, 64]))
    max_tokens = max(args.prefill_tokens or ([16, 48] if on_cpu else [64, 256, 1024]))
    phases = ["decode"] + ([] if args.no_prefill else ["prefill"])
    try:
        plans = {
            "decode": plan_phase("decode", args.decode_backends, config, device, max_bs),
        }
        if not args.no_prefill:
            plans["prefill"] = plan_phase("prefill", args.prefill_backends, config, device, max_tokens)
    except BenchRequestError as exc:
        return fail(str(exc), exc.exit_code)
    except CudaGraphConfigError as exc:
        return fail(str(exc))
    try:
        model = load_model(model_spec, dtype=dtype, device=device, attention=args.attention)
    except (ValueError, FileNotFoundError, RealModelUnavailableError, TransformersUnavailableError) as exc:
        return fail(str(exc))  # a bad --model, or one whose packages are missing

    say: Callable[[str], None] = (lambda text: print(text, file=sys.stderr)) if args.json else print
    runners: List[Any] = []
    try:
        for phase in phases:
            for choice in plans[phase]:
                if choice.note:
                    say(f"note: {choice.note}")
                if choice.backend is None:
                    continue
                choice.backend.keep_graph_templates = True  # node counts, off the replay path
                runners.append(_make_runner(phase, model, choice.config, device, choice.backend))
        _create_cache(model, runners)
        documents: List[Dict[str, Any]] = []
        for runner in runners:
            runner.capture()
            runner.capture_step(None)  # capture eager_first: describe every graph
            documents.append(runner.describe())
    finally:
        for runner in runners:
            runner.cleanup()
    if args.json:
        print(json.dumps(documents, indent=2))
    else:
        say(f"model {model_spec} ({str(dtype).replace('torch.', '')}), device {device}, torch {torch.__version__}")
        for doc in documents:
            say("\n" + format_description(doc))
        if not documents:
            say("no runner captured anything (every phase's backend is disabled)")
    return EXIT_OK


def _create_cache(model: Any, runners: List[Any]) -> None:
    """One KV cache that every runner's capture fits: each decode size's requests plus a
    prefill capture's dummy requests (at most ``context`` tokens each)."""
    context = 64
    requests = 1
    for runner in runners:
        size = runner.max_size
        requests += size if runner.phase == "decode" else -(-size // context)
    model.create_kv_cache(num_slots=requests * context + 1, max_reqs=requests + 1, max_context_len=context)
