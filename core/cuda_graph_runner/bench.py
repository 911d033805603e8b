"""``cuda-graph-runner bench``: the main job.

Loads the reference model (a preset with random weights, or a Hugging Face checkpoint
directory), then for each selected backend:

* decode: prefills ``batch_size`` prompts, checks that greedy decoding through the
  runner gives the tokens eager decoding gives, and times one decode step eagerly and
  through the runner (the runner's ``replay_prepare`` included);
* prefill: times batches of several requests summing to each token count, eager vs
  through the runner, and checks the last-token logits agree.

Times are milliseconds per step (mean over ``--iters`` runs after warm-ups, one device
synchronize per measurement); capture seconds and graph memory are per runner (all
sizes).

Output: tables on stdout (``--format table``), or the JSON document (schema
:data:`BENCH_SCHEMA`, also ``--json PATH``) or CSV rows (:data:`CSV_COLUMNS`) with
``--format json|csv``, the words for people then on stderr; ``--plot FILE`` draws a PNG
(:mod:`cuda_graph_runner.plot`). Each runner's run statistics (replays, eager fallbacks
by reason, padding waste) go into the JSON and, with ``-v``, the log. docs/cli.md.

Backends the bench chose itself (the device's default: no ``--decode-backends`` and no
backend in the config) that cannot run give a note and eager numbers under backend
``disabled``. A backend named explicitly (``--decode-backends``, ``--prefill-backends`` or
the config) that cannot run is an error before any work: exit 2 for an unknown name or a
bad option, 1 for one installed but failed, in conflict, unavailable here or breaking the
backend contract. ``--device`` naming a device this machine lacks is exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .config import CudaGraphConfig, CudaGraphConfigError, add_cuda_graph_args
from .errors import CudaGraphRunnerError, UnknownBackendError
from .forward_batch import ForwardBatch
from .tables import format_cell as _fmt
from .tables import format_table  # noqa: F401 - also importable from here, as before

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: The ``"schema"`` of the bench's JSON (``--json PATH``, ``--format json``); the plotter
#: (:mod:`cuda_graph_runner.plot`) reads it and benchmarks/run.py's.
BENCH_SCHEMA = "cuda-graph-runner.bench/1"
FORMATS = ("table", "json", "csv")

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RunnerStats:
    """Capture numbers of one runner."""

    phase: str
    backend: str
    sizes: List[int]
    capture_s: Optional[float]
    graph_memory_mb: Optional[float]
    compile_s: Optional[float] = None
    #: ``runner.run_stats()`` after the measurements (replays, eager fallbacks by reason,
    #: padding waste per captured size; :mod:`cuda_graph_runner.runner.stats`).
    run_stats: Optional[Dict[str, Any]] = None


def time_ms(fn: Callable[[], Any], *, iters: int, warmup: int, sync: Callable[[], None], repeats: int = 5) -> float:
    """Wall time of one ``fn()`` in ms: the median over ``repeats`` blocks of the mean of
    ``iters`` calls, after ``warmup`` calls.

    One synchronize before and after each block, so asynchronous device work is counted
    and host launch overhead overlaps with it as it does in serving; the median keeps a
    stall of a busy machine out of the number.
    """
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        samples.append((time.perf_counter() - start) * 1000.0 / iters)
    return statistics.median(samples)


def replay_prepare_us(runner: Any, batch: ForwardBatch, *, sync: Callable[[], None], iters: int = 200) -> float:
    """Host time of one ``runner.replay_prepare(batch)`` in µs: the median of ``iters``
    single calls (the copies it enqueues are not waited for; one synchronize after)."""
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        runner.replay_prepare(batch)
        samples.append((time.perf_counter() - start) * 1e6)
    sync()
    return statistics.median(samples)


def load_model(spec: str, *, dtype: torch.dtype, device: torch.device, tp_group: Any = None) -> Any:
    """A preset name (see ``testing.model.PRESETS``) or a checkpoint directory.

    Raises:
        ValueError: ``spec`` is neither a preset nor a directory (lists the presets).
    """
    from .testing.model import PRESETS, ReferenceLlamaForCausalLM

    if spec in PRESETS:
        return ReferenceLlamaForCausalLM.from_preset(spec, dtype=dtype, device=device, tp_group=tp_group)
    if os.path.isdir(spec):
        return ReferenceLlamaForCausalLM.from_pretrained(spec, dtype=dtype, device=device, tp_group=tp_group)
    raise ValueError(f"--model {spec!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a checkpoint directory")


def _sync_fn(device: torch.device) -> Callable[[], None]:
    if device.type == "cpu":
        return lambda: None
    module = torch.get_device_module(device)
    return lambda: module.synchronize(device)  # this device, not whichever is current


def _make_runner(kind: str, model: Any, config: CudaGraphConfig, device: torch.device) -> Any:
    from .runner import DecodeCudaGraphRunner

    if kind == "decode":
        return DecodeCudaGraphRunner(model, config, device=device)
    from .runner import PrefillCudaGraphRunner  # noqa: F401 - may not exist in old installs

    return PrefillCudaGraphRunner(model, config, device=device)


def _capture(runner: Any) -> RunnerStats:
    runner.capture()
    mem = runner.capture_memory_bytes
    return RunnerStats(
        runner.phase,
        runner.backend.name,
        list(runner.capture_sizes),
        runner.capture_seconds,
        None if mem is None else mem / 2**20,
        getattr(runner.backend, "compile_seconds", None),
    )


def bench_decode(
    model: Any,
    runner: Any,
    *,
    batch_sizes: Sequence[int],
    prompt_len: int,
    steps: int,
    iters: int,
    warmup: int,
    seed: int = 0,
) -> List[Dict[str, Any]]:
    """Rows ``{batch_size, eager_ms, graph_ms, speedup, tokens_match, max_abs_diff}``, plus
    ``replay_prepare_us`` (host µs of ``replay_prepare``, median) where the batch replays.

    ``runner`` None means eager only (graph columns None).
    """
    from .testing.batches import GreedySession, eager_logits_fn, make_decode_batch, make_dummy_prompts

    cache = model.kv_cache
    sync = _sync_fn(model.device)
    eager = eager_logits_fn(model)
    rows = []
    for bs in batch_sizes:
        prompts = make_dummy_prompts(bs, prompt_len, model.config.vocab_size, seed=seed + bs)
        ref = GreedySession(model, cache)
        with torch.no_grad():
            ref.prefill(prompts)
            ref_logits = [ref.decode().clone() for _ in range(steps)]
            ref_tokens = ref.tokens
            ref.close()
            row: Dict[str, Any] = {"batch_size": bs}
            # Timing: the same decode batch replayed; each run rewrites the same KV slots.
            timing = GreedySession(model, cache)
            timing.prefill(prompts)
            batch = make_decode_batch(cache, timing.rows, None, [t[-1] for t in timing.tokens])
            row["eager_ms"] = time_ms(lambda: eager(batch), iters=iters, warmup=warmup, sync=sync)
            if runner is not None:
                row["graph_ms"] = time_ms(lambda: runner.forward(batch), iters=iters, warmup=warmup, sync=sync)
                row["replayed"] = runner.can_run(batch)
                if row["replayed"]:
                    row["replay_prepare_us"] = replay_prepare_us(runner, batch, sync=sync)
            timing.close()
            if runner is not None:
                got = GreedySession(model, cache, decode_fn=lambda b: runner.forward(b).clone())
                got.prefill(prompts)
                got_logits = [got.decode() for _ in range(steps)]
                row["tokens_match"] = got.tokens == ref_tokens
                row["max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(ref_logits, got_logits))
                got.close()
        row["speedup"] = row["eager_ms"] / row["graph_ms"] if row.get("graph_ms") else None
        rows.append(row)
    return rows


def _split(total: int, parts: int) -> List[int]:
    base, rest = divmod(total, parts)
    return [base + (1 if i < rest else 0) for i in range(parts)]


def bench_prefill(
    model: Any,
    runner: Any,
    *,
    token_counts: Sequence[int],
    requests: Sequence[int],
    iters: int,
    warmup: int,
    seed: int = 0,
) -> List[Dict[str, Any]]:
    """Rows ``{num_tokens, requests, eager_ms, graph_ms, speedup, replayed, max_abs_diff, argmax_match}``."""
    from .testing.batches import eager_logits_fn, make_dummy_prompts, make_extend_batch

    cache = model.kv_cache
    sync = _sync_fn(model.device)
    eager = eager_logits_fn(model)
    rows = []
    for total in token_counts:
        for n_req in requests:
            if n_req > total:
                continue
            lengths = _split(total, n_req)
            prompts = make_dummy_prompts(n_req, lengths, model.config.vocab_size, seed=seed + total)
            reqs = [cache.alloc_request() for _ in prompts]
            batch = make_extend_batch(cache, prompts, rows=reqs)
            row: Dict[str, Any] = {"num_tokens": total, "requests": n_req}
            with torch.no_grad():
                ref = eager(batch).clone()
                row["eager_ms"] = time_ms(lambda: eager(batch), iters=iters, warmup=warmup, sync=sync)
                if runner is not None:
                    got = runner.forward(batch).clone()
                    row["replayed"] = runner.can_run(batch)
                    row["max_abs_diff"] = float((got - ref).abs().max())
                    row["argmax_match"] = bool((got.argmax(-1) == ref.argmax(-1)).all())
                    row["graph_ms"] = time_ms(lambda: runner.forward(batch), iters=iters, warmup=warmup, sync=sync)
            for r in reqs:
                cache.free_request(r)
            row["speedup"] = row["eager_ms"] / row["graph_ms"] if row.get("graph_ms") else None
            rows.append(row)
    return rows


#: Columns of ``--format csv``: one row per decode batch size or prefill (tokens,
#: requests) per backend; a phase leaves the other phase's columns empty.
CSV_COLUMNS = (
    "phase",
    "backend",
    "batch_size",
    "num_tokens",
    "requests",
    "eager_ms",
    "graph_ms",
    "speedup",
    "replay_prepare_us",
    "replayed",
    "tokens_match",
    "argmax_match",
    "max_abs_diff",
)


def results_csv(results: Dict[str, Any]) -> str:
    """The decode and prefill rows of ``results`` as CSV text (header :data:`CSV_COLUMNS`;
    booleans ``true``/``false``, missing values empty)."""
    import csv
    import io

    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for phase in ("decode", "prefill"):
        for row in results.get(phase, []):
            cells = {k: ("true" if v else "false") if isinstance(v, bool) else v for k, v in row.items()}
            writer.writerow({"phase": phase, **cells})
    return out.getvalue()


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` flags (plus every CUDA-graph config flag)."""
    parser.add_argument(
        "--model",
        default=None,
        help="preset name or Hugging Face checkpoint directory (default: llama-3.2-1b on CUDA, tiny on CPU)",
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="model dtype (default: bfloat16 on CUDA, float32 on CPU)"
    )
    parser.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        default=None,
        help="decode batch sizes to time (default: 1 4 16 64 on CUDA, 1 2 4 on CPU)",
    )
    parser.add_argument(
        "--decode-backends",
        default=None,
        help="comma-separated decode backends to bench, each name[:tc_compiler], e.g. "
        "full,tc_piecewise:inductor (default: the config's decode backend)",
    )
    parser.add_argument(
        "--prefill-backends",
        default=None,
        help="comma-separated prefill backends to bench, each name[:tc_compiler] "
        "(default: the config's prefill backend)",
    )
    parser.add_argument(
        "--prefill-tokens",
        type=int,
        nargs="+",
        default=None,
        help="prefill token counts to time (default: 64 256 1024 on CUDA, 16 48 on CPU)",
    )
    parser.add_argument(
        "--prefill-requests", type=int, nargs="+", default=[1, 4], help="requests per prefill batch (default: 1 4)"
    )
    parser.add_argument("--no-prefill", action="store_true", help="skip the prefill section")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens before decoding (default 32)")
    parser.add_argument("--steps", type=int, default=16, help="greedy decode steps compared with eager (default 16)")
    parser.add_argument(
        "--iters",
        type=int,
        default=None,
        help="calls per timed block; the median of 5 blocks is reported (default 20 on CUDA, 2 on CPU)",
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs before each measurement (default 3)")
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel size; >1 runs under torchrun --nproc-per-node N, rank 0 prints (default 1)",
    )
    parser.add_argument("--json", dest="json_path", default=None, help="also write the results as JSON to this path")
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="table",
        help="stdout format: table (default, for people), json (the --json document) or csv "
        "(one row per measurement); with json/csv the progress text goes to stderr",
    )
    parser.add_argument(
        "--plot",
        dest="plot_path",
        default=None,
        metavar="FILE",
        help="also draw ms per step against batch size (and prefill ms against tokens) per "
        "backend, eager included, into this PNG (needs cuda-graph-runner[plot])",
    )
    add_cuda_graph_args(parser)


def _backends(arg: Optional[str], configured: Optional[str]) -> List[Tuple[Optional[str], Optional[str]]]:
    """``[(backend or None for auto, tc_compiler or None)]`` from ``"full,tc_piecewise:inductor"``."""
    if arg:
        labels = [b.strip() for b in arg.split(",") if b.strip()]
        return [(name, compiler or None) for name, _, compiler in (label.partition(":") for label in labels)]
    return [(configured, None)]


class BenchRequestError(Exception):
    """A backend named explicitly cannot be benched; ``exit_code`` 2 (usage) or 1 (runtime)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def device_problem(device: torch.device) -> Optional[str]:
    """Why ``device`` cannot be used on this machine (no such device, torch built without
    it, index out of range), or None."""
    if device.type == "cpu":
        return None
    try:
        module = torch.get_device_module(device)
    except Exception as exc:  # torch knows the type but has no module for it
        return f"torch {torch.__version__} has no {device.type} support ({exc})"
    available = getattr(module, "is_available", None)
    if available is None or not available():
        built = ""
        if device.type == "cuda" and torch.version.cuda is None:
            built = f"; this torch {torch.__version__} was built without CUDA"
        return f"no {device.type} device is available here{built}"
    count = getattr(module, "device_count", lambda: 1)()
    if device.index is not None and device.index >= count:
        return f"{device} does not exist: this machine has {count} {device.type} device(s)"
    return None


def check_explicit_backends(
    phase: str, selection: Optional[str], config: CudaGraphConfig, device: torch.device
) -> None:
    """Fail before any work when a backend named for ``phase`` cannot be benched.

    Raises:
        BenchRequestError: exit 2 for an unknown name or an option the backend does not
            read, 1 for a backend that is failed, in conflict, unavailable here, not for the
            phase or breaks the contract. The message says which and why.
    """
    from . import backend_options
    from .registry import get_registry

    if not selection and config[phase].backend is None:
        return  # the bench chooses: notes, not errors
    reg = get_registry()
    for name, compiler in _backends(selection, config[phase].backend):
        if name is None or name == "disabled":
            continue
        where = f"--{phase}-backends" if selection else "the config"
        try:
            entry = reg.get(name, device_type=device.type, phase=phase)
            reg.load_class(entry)  # a contract-broken class fails here, not mid-bench
            fields = {"backend": name, **({"tc_compiler": compiler} if compiler else {})}
            backend_options.check_resolved(reg, phase, config.with_phase(phase, **fields), entry)
        except (UnknownBackendError, CudaGraphConfigError) as exc:
            raise BenchRequestError(f"{phase} backend {name!r} (from {where}): {exc}", 2) from None
        except CudaGraphRunnerError as exc:
            raise BenchRequestError(
                f"{phase} backend {name!r} was asked for ({where}) but cannot run: {exc}", 1
            ) from None


def _bench_phase(
    phase: str,
    selection: Optional[str],
    config: CudaGraphConfig,
    model: Any,
    device: torch.device,
    default_max: int,
    results: Dict[str, Any],
    table: Any,
    measure: Callable[[Any], List[Dict[str, Any]]],
    say: Callable[[str], None] = print,
) -> bool:
    """Capture (when a backend is usable), measure, print one table per backend; True if
    a graph result disagreed with eager."""
    headers, cells = table
    phase_config = config[phase]
    failed = False
    for name, compiler in _backends(selection, phase_config.backend):
        backend, note = _resolve_or_explain(phase, name, device)
        runner, stats = None, None
        if backend is not None:
            fields: Dict[str, Any] = {
                "backend": backend,
                "max_bs": phase_config.max_bs or (None if phase_config.bs else default_max),
            }
            if compiler:
                fields["tc_compiler"] = compiler
            try:
                runner = _make_runner(phase, model, config.with_phase(phase, **fields), device)
            except CudaGraphRunnerError as exc:
                if name is not None:  # asked for: check_explicit_backends should have caught it
                    raise
                runner, backend, note = None, None, f"{phase} backend {backend!r} skipped: {exc}; running eager only"
        if runner is not None:
            stats = _capture(runner)
            runner.stats.reset()  # count the measured calls only
        if note:
            say(f"note: {note}")
            results["notes"].append(note)
        rows = measure(runner)
        if stats is not None:
            stats.run_stats = runner.run_stats()
            results["runners"].append(dataclasses.asdict(stats))
            from .runner.stats import format_summary

            logger.info("%s", format_summary(f"{phase} runner {stats.backend}", stats.run_stats))
        # The backend's own name: eager numbers come from backend "disabled".
        label = (backend + (f":{compiler}" if compiler else "")) if backend else "disabled"
        header = f"\n{phase}, backend {label}"
        if stats is not None:
            header += (
                f": captured {len(stats.sizes)} sizes in {stats.capture_s:.2f} s"
                + (
                    f" (compile {stats.compile_s:.2f} s, capture {max(0.0, stats.capture_s - stats.compile_s):.2f} s)"
                    if stats.compile_s is not None and stats.capture_s is not None
                    else ""
                )
                + f", graph memory {_fmt(stats.graph_memory_mb, '.1f')} MB"
            )
        say(header)
        say(format_table(headers, [cells(r) for r in rows]))
        for r in rows:
            r["backend"] = label
            failed |= r.get("tokens_match") is False or r.get("argmax_match") is False
        results[phase].extend(rows)
        if runner is not None:
            runner.cleanup()
    return failed


#: Backends the bench picks itself, in order, where the device's default is ``disabled``
#: (the CPU): the runner never defaults to them (compiling costs tens of seconds), but
#: the main job shows what a compiled forward gains. Names only: the core imports no plugin.
BENCH_PREFERRED = {"cpu": ("compiled",)}


def _bench_choice(reg: Any, phase: str, device: torch.device) -> Optional[str]:
    """The first of :data:`BENCH_PREFERRED` for ``device`` usable for ``phase``, else None
    (always None when ``CUDA_GRAPH_RUNNER_BENCH_CPU_COMPILED`` is off)."""
    from . import envs

    if not envs.get(envs.BENCH_CPU_COMPILED):
        return None
    for candidate in BENCH_PREFERRED.get(device.type, ()):
        try:
            reg.get(candidate, device_type=device.type, phase=phase)
        except CudaGraphRunnerError:
            continue
        return candidate
    return None


def _resolve_or_explain(phase: str, name: Optional[str], device: torch.device) -> "tuple[Optional[str], str]":
    """(backend name to use or None for eager only, a note)."""
    from .registry import get_registry, list_backends

    reg = get_registry()
    chosen = name or reg.default_backend(phase, device.type)
    if name is None and chosen == "disabled":
        chosen = _bench_choice(reg, phase, device) or chosen
    if chosen == "disabled":
        if name is None:
            blocked = [
                f"{e.name}: {e.reason}"
                for e in list_backends()
                if phase in e.phases and e.name != "disabled" and not e.ok
            ]
            why = "; ".join(blocked) if blocked else "no graph backend is installed for this phase"
            return None, f"no {phase} graph backend is usable on {device.type} ({why}); running eager only"
        return None, f"{phase} backend 'disabled': running eager only"
    try:
        reg.get(chosen, device_type=device.type, phase=phase)
    except CudaGraphRunnerError as exc:
        if name is not None:  # asked for by name: an error (check_explicit_backends reports it first)
            raise
        return None, f"{phase} backend {chosen!r} skipped: {exc}; running eager only"
    return chosen, ""


def run_bench(args: argparse.Namespace) -> int:
    """Run the bench from parsed arguments; returns the exit status (1 when a graph
    result disagrees with eager). With ``--tp N`` > 1 every rank ends here in bounded
    time (:mod:`cuda_graph_runner.bench_tp`)."""
    from . import bench_tp

    try:
        tp = bench_tp.setup(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        code = _run_bench(args, tp)
    except BaseException:
        if tp is None:
            raise
        import traceback

        traceback.print_exc()
        code = 1
    return bench_tp.finish(tp, code)


def _run_bench(args: argparse.Namespace, tp: Any) -> int:
    try:
        config = CudaGraphConfig.from_args(args)
    except CudaGraphConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for flag, path in (("--json", args.json_path), ("--plot", getattr(args, "plot_path", None))):
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            # Checked before minutes of capture and timing, not after.
            print(f"error: {flag} {path!r}: folder {folder!r} does not exist or is not writable", file=sys.stderr)
            return 2
    if getattr(args, "plot_path", None):
        from .plot import PlotUnavailableError, check_plot_available

        try:
            check_plot_available()
        except PlotUnavailableError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    fmt = getattr(args, "format", "table")
    # With a machine-readable stdout the words for people go to stderr.
    say: Callable[[str], None] = print if fmt == "table" else (lambda text: print(text, file=sys.stderr))
    if tp is not None and tp.rank != 0:  # rank 0 speaks for all ranks (stdout is closed on the others)
        say = lambda text: None  # noqa: E731
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, ValueError) as exc:
        print(
            f"error: --device {args.device!r} is not a torch device ({str(exc).splitlines()[0]}); "
            "accepted: cpu, cuda, cuda:N, npu:N, ...",
            file=sys.stderr,
        )
        return 2
    problem = device_problem(device)
    if problem:
        print(f"error: --device {args.device!r}: {problem}", file=sys.stderr)
        return 2
    try:
        from . import backend_options
        from .registry import get_registry

        phases = [("decode", args.decode_backends)] + ([] if args.no_prefill else [("prefill", args.prefill_backends)])
        for phase, selection in phases:
            check_explicit_backends(phase, selection, config, device)
        if not (args.decode_backends or args.prefill_backends):
            backend_options.check_with_registry(config, get_registry(), device.type)
    except BenchRequestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except CudaGraphConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    on_cpu = device.type == "cpu"
    dtype = DTYPES[args.dtype or ("float32" if on_cpu else "bfloat16")]
    model_spec = args.model or ("tiny" if on_cpu else "llama-3.2-1b")
    batch_sizes = sorted(set(args.batch_sizes or ([1, 2, 4] if on_cpu else [1, 4, 16, 64])))
    token_counts = sorted(set(args.prefill_tokens or ([16, 48] if on_cpu else [64, 256, 1024])))
    iters = args.iters or (2 if on_cpu else 20)
    bad = [n for n in batch_sizes + token_counts if n <= 0]
    if bad:
        print(f"error: batch sizes and token counts must be positive, got {bad}", file=sys.stderr)
        return 2

    try:
        model = load_model(model_spec, dtype=dtype, device=device, tp_group=tp)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    max_bs, max_tokens = max(batch_sizes), max(token_counts)
    # Decode attention reads max_context_len keys per request, so each section gets a
    # cache just long enough for it (three sessions of max_bs requests live at once).
    context = args.prompt_len + args.steps + 8
    max_reqs = max_bs * 3 + 1
    model.create_kv_cache(num_slots=max_reqs * context + 1, max_reqs=max_reqs, max_context_len=context)
    env = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "model": model_spec,
        "dtype": str(dtype).replace("torch.", ""),
    }
    if tp is not None:
        env["tp"] = tp.size
    say(
        f"model {model_spec} ({dtype}), device {env['device_name']}, torch {torch.__version__}"
        + (f", tensor parallel {tp.size} ranks (rank 0 shown)" if tp is not None else "")
    )
    results: Dict[str, Any] = {
        "schema": BENCH_SCHEMA,
        "env": env,
        "runners": [],
        "decode": [],
        "prefill": [],
        "notes": [],
    }

    decode_table = (
        ["batch", "eager ms", "graph ms", "speedup", "prepare us", "tokens match", "max |diff|"],
        lambda r: [
            r["batch_size"],
            r["eager_ms"],
            r.get("graph_ms"),
            r.get("speedup"),
            r.get("replay_prepare_us"),
            r.get("tokens_match"),
            r.get("max_abs_diff"),
        ],
    )
    failed = _bench_phase(
        "decode",
        args.decode_backends,
        config,
        model,
        device,
        max_bs,
        results,
        decode_table,
        lambda runner: bench_decode(
            model,
            runner,
            batch_sizes=batch_sizes,
            prompt_len=args.prompt_len,
            steps=args.steps,
            iters=iters,
            warmup=args.warmup,
        ),
        say,
    )
    if not args.no_prefill:
        max_reqs = max(args.prefill_requests) + 1
        model.create_kv_cache(num_slots=max_reqs * max_tokens + 1, max_reqs=max_reqs, max_context_len=max_tokens)
        prefill_table = (
            ["tokens", "requests", "eager ms", "graph ms", "speedup", "replayed", "argmax match", "max |diff|"],
            lambda r: [
                r["num_tokens"],
                r["requests"],
                r["eager_ms"],
                r.get("graph_ms"),
                r.get("speedup"),
                r.get("replayed"),
                r.get("argmax_match"),
                r.get("max_abs_diff"),
            ],
        )
        failed |= _bench_phase(
            "prefill",
            args.prefill_backends,
            config,
            model,
            device,
            max_tokens,
            results,
            prefill_table,
            lambda runner: bench_prefill(
                model,
                runner,
                token_counts=token_counts,
                requests=args.prefill_requests,
                iters=iters,
                warmup=args.warmup,
            ),
            say,
        )

    if args.json_path and (tp is None or tp.rank == 0):
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=2)
        say(f"\nwrote {args.json_path}")
    if getattr(args, "plot_path", None) and (tp is None or tp.rank == 0):
        from .plot import plot_results

        plot_results(results, args.plot_path)
        say(f"wrote {args.plot_path}")
    if fmt == "json":
        print(json.dumps(results, indent=2))
    elif fmt == "csv":
        sys.stdout.write(results_csv(results))
    if failed:
        print("\nerror: a graph result disagreed with eager (tokens or argmax); see the tables", file=sys.stderr)
    return 1 if failed else 0
