"""``cuda-graph-runner bench``: the main job.

Loads the reference model (a preset with random weights, or a Hugging Face checkpoint
directory), then for each selected backend:

* decode: prefills ``batch_size`` prompts, checks that greedy decoding through the
  runner gives the tokens eager decoding gives, and times one decode step eagerly and
  through the runner (the runner's ``replay_prepare`` included);
* prefill: times batches of several requests summing to each token count, eager vs
  through the runner, and checks the last-token logits agree.

Times are milliseconds per step (mean over ``--iters`` runs after warm-ups, one device
synchronize per measurement). Eager and the backend are timed interleaved, round by round
(:func:`cuda_graph_runner.cli.bench.measure.paired_ms`: 5 rounds, 15 on the CPU): the times
are the median rounds, ``speedup`` their ratio eager / graph (as printed) and
``per-round min-max`` the lowest and highest ratio of one round; ``replayed`` says whether
the batch replayed a graph (no: the runner ran it eagerly, so ``graph ms`` is eager too).
Capture seconds and graph memory are per runner (all sizes).

Output: tables on stdout (``--format table``), or the JSON document (the schema of
:mod:`cuda_graph_runner.cli.results_schema`, shared with benchmarks/run.py; also ``--json PATH``) or CSV rows (:data:`CSV_COLUMNS`) with
``--format json|csv``, the words for people then on stderr; ``--plot FILE`` draws a PNG
(:mod:`cuda_graph_runner.cli.plot`). Each runner's run statistics (replays, eager fallbacks
by reason, padding waste) go into the JSON and, with ``-v``, the log. docs/cli.md.

Backends the bench chose itself (the device's default: no ``--decode-backends`` and no
backend in the config) that cannot run give a note and eager numbers under backend
``disabled``; a backend option they do not read (``compile_sizes`` with the CPU's pick
``compiled``) is an error, exit 2, as in ``cuda-graph-runner config``. A backend named explicitly (``--decode-backends``, ``--prefill-backends`` or
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
import sys
from typing import Any, Callable, Dict, List, Optional

import torch

from ...backend import envs
from ...backend.errors import CudaGraphRunnerError
from ...config import CudaGraphConfig, CudaGraphConfigError
from ..results_schema import SCHEMA
from ..tables import format_cell as _fmt
from ..tables import format_table
from .args import DTYPES, FORMATS, add_bench_arguments  # noqa: F401 - importable from here too
from .backends import BackendChoice, BenchRequestError, bench_picks, device_problem, plan_phase
from .measure import (  # noqa: F401
    DEFAULT_PAIRED_ROUNDS,
    PAIRED_ROUNDS,
    bench_decode,
    bench_prefill,
    busy_note,
    replay_prepare_us,
    time_ms,
)
from .output import CSV_COLUMNS, results_csv, results_document  # noqa: F401 - importable from here too

#: The ``"schema"`` of the bench's JSON (``--json PATH``, ``--format json``), shared with
#: benchmarks/run.py (:mod:`cuda_graph_runner.cli.results_schema`).
BENCH_SCHEMA = SCHEMA

logger = logging.getLogger(__name__)
#: Tokens generated per prompt for a real model's text (``--model smollm2-135m``).
GENERATED_TOKENS = 8


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


#: The timing columns of both tables: ``speedup`` is the printed ``eager ms`` / ``graph ms``;
#: ``per-round min-max`` the lowest and highest eager/graph ratio of the interleaved rounds.
TIMING_HEADERS = ["eager ms", "graph ms", "speedup", "per-round min-max"]


def _speedup(row: Dict[str, Any]) -> Optional[str]:
    """``"1.32x"``: a row's ``speedup`` (eager ms / graph ms), or None."""
    value = row.get("speedup")
    return None if value is None else f"{value:.2f}x"


def _speedup_range(row: Dict[str, Any]) -> Optional[str]:
    """``"0.95x-1.40x"``: the lowest and highest per-round speedup of a row
    (:func:`bench_measure.paired_ms`), or None."""
    lo, hi = row.get("speedup_lo"), row.get("speedup_hi")
    return None if lo is None or hi is None else f"{lo:.2f}x-{hi:.2f}x"


def load_model(
    spec: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
    tp_group: Any = None,
    attention: Optional[str] = None,
    dp_group: Any = None,
) -> Any:
    """A preset name (see ``testing.model.PRESETS``), a real model name
    (:data:`cuda_graph_runner.reference.real_model.REAL_MODELS`: its checkpoint prepared once into the
    cache), a checkpoint directory, or ``hf:<arch>`` / ``hf:<folder>`` (transformers' own
    model through :mod:`cuda_graph_runner.reference.models.hf`), with the attention backend
    ``attention`` (None: ``torch``; :mod:`cuda_graph_runner.reference.model.attention_backend`).

    Raises:
        ValueError: ``spec`` is none of these (lists the presets and real models), or
            ``hf:`` with tensor parallelism or a model the adapter refuses, or
            ``dp_group`` with anything but a preset (the DP layout has random weights).
        RealModelUnavailableError: a real model whose packages are not installed.
        TransformersUnavailableError: ``hf:`` without transformers.
    """
    from ...reference.model import PRESETS, ReferenceLlamaForCausalLM
    from ...reference.real_model import REAL_MODELS, prepare

    if spec.startswith("hf:"):
        from ...reference.models.hf import load_hf_model

        if tp_group is not None or dp_group is not None:
            raise ValueError(
                f"--model {spec!r}: the Hugging Face adapter runs on one rank (no tensor or data parallelism)"
            )
        return load_hf_model(spec, dtype=dtype, device=device, attention=attention)

    if dp_group is not None:
        if spec not in PRESETS:
            raise ValueError(
                f"--model {spec!r} with --dp: data parallelism runs the reference presets only "
                f"({', '.join(sorted(PRESETS))})"
            )
        return ReferenceLlamaForCausalLM.from_preset(
            spec, dtype=dtype, device=device, dp_group=dp_group, attention=attention
        )
    if spec in REAL_MODELS:
        spec = prepare(spec)
    if spec in PRESETS:
        return ReferenceLlamaForCausalLM.from_preset(
            spec, dtype=dtype, device=device, tp_group=tp_group, attention=attention
        )
    if os.path.isdir(spec):
        return ReferenceLlamaForCausalLM.from_pretrained(
            spec, dtype=dtype, device=device, tp_group=tp_group, attention=attention
        )
    raise ValueError(
        f"--model {spec!r} is neither a preset ({', '.join(sorted(PRESETS))}), a real model "
        f"({', '.join(sorted(REAL_MODELS))}) nor a checkpoint directory"
    )


def _make_runner(kind: str, model: Any, config: CudaGraphConfig, device: torch.device, backend: Any) -> Any:
    """The ``kind`` runner over ``model`` with ``backend`` already resolved (not again)."""
    from ...runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner

    cls = DecodeCudaGraphRunner if kind == "decode" else PrefillCudaGraphRunner
    return cls(model, config, device=device, backend=backend)


def _capture(runner: Any) -> RunnerStats:
    runner.capture()
    runner.capture_step(None)  # capture eager_first: the bench measures replays, so every size
    mem = runner.capture_memory_bytes
    return RunnerStats(
        runner.phase,
        runner.backend.name,
        list(runner.capture_sizes),
        runner.capture_seconds,
        None if mem is None else mem / 2**20,
        getattr(runner.backend, "compile_seconds", None),
    )


def _bench_phase(
    phase: str,
    choices: List[BackendChoice],
    model: Any,
    device: torch.device,
    results: Dict[str, Any],
    table: Any,
    measure: Callable[[Any], List[Dict[str, Any]]],
    say: Callable[[str], None] = print,
    after: Optional[Callable[[Any, str], None]] = None,
) -> bool:
    """Capture (when a backend is usable), measure, print one table per backend (then
    ``after(runner, label)``, e.g. the generated text); True if a graph result disagreed
    with eager."""
    headers, cells = table
    failed = False
    for choice in choices:
        label, note, runner, stats = choice.label, choice.note, None, None
        if choice.backend is not None:
            try:
                runner = _make_runner(phase, model, choice.config, device, choice.backend)
            except CudaGraphConfigError:  # the user's config, whoever picked the backend: never skipped
                raise
            except CudaGraphRunnerError as exc:
                if choice.explicit:
                    raise
                label, note = "disabled", f"{phase} backend {choice.label!r} skipped: {exc}; running eager only"
        if runner is not None:
            stats = _capture(runner)
            runner.stats.reset()  # count the measured calls only
            if runner.eager_through and not runner.is_disabled:  # else its column reads as graph times
                through = (
                    f"{phase}: eager-through mode is on ({envs.EAGER_THROUGH} or the config key eager_through): "
                    "no graph replays; the graph column times the eager forward on the padded static batch"
                )
                note = f"{note}; {through}" if note else through
        if note:
            say(f"note: {note}")
            results["notes"].append(note)
        rows = measure(runner)
        if stats is not None and runner is not None:  # a capture needs a runner
            stats.run_stats = runner.run_stats()
            results["runners"].append(dataclasses.asdict(stats))
            from ...runner.stats import format_summary

            logger.info("%s", format_summary(f"{phase} runner {stats.backend}", stats.run_stats))
        # The backend's own name: eager numbers come from backend "disabled".
        header = f"\n{phase}, backend {label}"
        if stats is not None:
            header += (
                f": captured {len(stats.sizes)} size{'' if len(stats.sizes) == 1 else 's'} in {stats.capture_s:.2f} s"
                + (
                    f" (compile {stats.compile_s:.2f} s, capture {max(0.0, stats.capture_s - stats.compile_s):.2f} s)"
                    if stats.compile_s is not None and stats.capture_s is not None
                    else ""
                )
                + f", graph memory {_fmt(stats.graph_memory_mb, '.1f')} MB"
            )
        say(header)
        say(format_table(headers, [cells(r) for r in rows]))
        if after is not None:
            after(runner, label)
        for r in rows:
            r["backend"] = label
            # A graph result outside the backend's tolerance fails the run; tokens that part
            # at a near-tie within it are reported (the table) but are no error.
            failed |= r.get("within_tolerance") is False
        results[phase].extend(rows)
        if runner is not None:
            runner.cleanup()
    return failed


def output_problem(args: argparse.Namespace) -> Optional[str]:
    """Why the output files of ``args`` cannot be written, or None: each of ``--json`` and
    ``--plot`` a writable file (:func:`bench_args.output_file`, argparse checks it too), not
    the same file, and the plot's format one matplotlib draws (it is installed). Checked
    before minutes of capture and timing, so no result is lost at the end."""
    from .args import output_file

    plot_path = getattr(args, "plot_path", None)
    paths = [(flag, path) for flag, path in (("--json", args.json_path), ("--plot", plot_path)) if path]
    for flag, path in paths:
        try:
            output_file(path)
        except argparse.ArgumentTypeError as exc:
            return f"argument {flag}: {exc}"
    if len(paths) == 2 and os.path.abspath(paths[0][1]) == os.path.abspath(paths[1][1]):
        return f"--json and --plot name the same file {paths[0][1]!r}; accepted: two different files"
    if plot_path:
        from ..plot import PlotUnavailableError, check_plot_available, plot_format_problem

        try:
            check_plot_available()
        except PlotUnavailableError as exc:
            return str(exc)
        return plot_format_problem(plot_path)
    return None


def run_bench(args: argparse.Namespace) -> int:
    """Run the bench from parsed arguments; returns the exit status (1 when a graph
    result disagrees with eager). With ``--tp N`` > 1 every rank ends here in bounded
    time (:mod:`cuda_graph_runner.cli.bench.tp`)."""
    from . import tp as bench_tp

    try:
        tp = bench_tp.setup(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    try:
        code = _run_bench(args, tp)
    except BaseException:
        if tp is None:
            raise
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        torch.set_num_threads(threads)  # the bench's choice (cpu_threads) ends with the run
    return bench_tp.finish(tp, code)


def _run_bench(args: argparse.Namespace, tp: Any) -> int:
    try:
        config = CudaGraphConfig.from_args(args)
    except CudaGraphConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    problem = output_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
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
    on_cpu = device.type == "cpu"
    dtype = DTYPES[args.dtype or ("float32" if on_cpu else "bfloat16")]
    model_spec = args.model or ("tiny" if on_cpu else "llama-3.2-1b")
    batch_sizes = sorted(set(args.batch_sizes or ([1, 2, 4] if on_cpu else [1, 4, 16, 64])))
    token_counts = sorted(set(args.prefill_tokens or ([16, 48] if on_cpu else [64, 256, 1024])))
    iters = args.iters or (2 if on_cpu else 20)
    rounds = PAIRED_ROUNDS.get(device.type, DEFAULT_PAIRED_ROUNDS)
    bad = [n for n in batch_sizes + token_counts if n <= 0]
    if bad:
        print(f"error: batch sizes and token counts must be positive, got {bad}", file=sys.stderr)
        return 2
    max_bs, max_tokens = max(batch_sizes), max(token_counts)
    never = sorted(n for n in set(args.prefill_requests) if n > max_tokens)
    if never and not args.no_prefill:
        # A batch of n requests needs n tokens at least: such a count would time nothing.
        print(
            f"error: --prefill-requests {','.join(map(str, never))}: more requests than the largest "
            f"--prefill-tokens ({max_tokens}), so no batch would be timed; accepted: request counts <= {max_tokens}",
            file=sys.stderr,
        )
        return 2
    threads, threads_from = None, ""
    if on_cpu or getattr(args, "threads", None) is not None:
        from .cpu_threads import choose_threads

        try:
            threads, threads_from = choose_threads(getattr(args, "threads", None), current=torch.get_num_threads())
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    from ...reference import real_model

    if model_spec.startswith("hf:"):
        from ...reference.models.hf import INSTALL_HINT, transformers_available

        if not transformers_available():  # before any work
            print(f"error: --model {model_spec} needs transformers: {INSTALL_HINT}", file=sys.stderr)
            return 2
    if model_spec in real_model.REAL_MODELS or model_spec[len("hf:") :] in real_model.REAL_MODELS:
        try:  # before any work: the packages a real model needs
            real_model.check_available(model_spec.removeprefix("hf:"))
        except real_model.RealModelUnavailableError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    opt_in = real_model.REAL_MODELS[model_spec].cpu_compiled_opt_in if model_spec in real_model.REAL_MODELS else ""
    not_picked = (
        f"not picked for --model {model_spec}: it {opt_in} (--decode-backends compiled runs it)" if opt_in else None
    )
    try:
        from ...backend import options as backend_options
        from ...registry import get_registry

        if not (args.decode_backends or args.prefill_backends):
            # A phase on auto is checked against what the bench will run (its own pick on
            # the CPU), as `config` checks it against the device's default.
            reg = get_registry()
            backend_options.check_with_registry(config, reg, device.type, bench_picks(reg, config, device, not_picked))
        # Each backend resolved once, before the model loads; the runners get the instances.
        plans = {"decode": plan_phase("decode", args.decode_backends, config, device, max_bs, not_picked)}
        if not args.no_prefill:
            plans["prefill"] = plan_phase("prefill", args.prefill_backends, config, device, max_tokens, not_picked)
    except BenchRequestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except CudaGraphConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    if threads is not None:
        torch.set_num_threads(threads)  # before any work: the eager steps, compiles and timings all use it
    try:
        from ...runner.dp_group import DPGroup

        dp = tp if isinstance(tp, DPGroup) else None
        model = load_model(
            model_spec,
            dtype=dtype,
            device=device,
            tp_group=None if dp is not None else tp,
            attention=args.attention,
            dp_group=dp,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    reference_logits = None
    if model_spec.startswith("hf:"):
        from ...reference.models.hf import eager_reference, reference_logits_fn

        reference_logits = reference_logits_fn(eager_reference(model))
    tokenizer, eager_texts = None, []
    if model_spec in real_model.REAL_MODELS:
        tokenizer = real_model.load_tokenizer(real_model.prepare(model_spec))  # prepared: returns at once
    # Decode attention reads max_context_len keys per request, so each section gets a
    # cache just long enough for it (three sessions of max_bs requests live at once).
    context = args.prompt_len + args.steps + 8
    if tokenizer is not None:
        longest = max(len(tokenizer(p)["input_ids"]) for p in real_model.PROMPTS)
        context = max(context, longest + GENERATED_TOKENS + 1)
    max_positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(max_positions, int) and args.prompt_len + args.steps > max_positions:
        print(
            f"error: --prompt-len {args.prompt_len} plus --steps {args.steps} is "
            f"{args.prompt_len + args.steps} positions; model {model_spec} takes at most "
            f"max_position_embeddings={max_positions}",
            file=sys.stderr,
        )
        return 2
    max_reqs = max_bs * 3 + 1
    model.create_kv_cache(num_slots=max_reqs * context + 1, max_reqs=max_reqs, max_context_len=context)
    env = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "model": model_spec,
        "dtype": str(dtype).replace("torch.", ""),
        "attention": model.attn_backend.name,
    }
    if tp is not None:
        env[tp.kind.lower()] = tp.size
    parallel = "data" if tp is not None and tp.kind == "DP" else "tensor"
    say(
        f"model {model_spec} ({dtype}), device {env['device_name']}, torch {torch.__version__}"
        + (f", {parallel} parallel {tp.size} ranks (rank 0 shown)" if tp is not None else "")
        + (f", attention {env['attention']}" if args.attention else "")
    )
    results: Dict[str, Any] = {
        "env": env,
        "runners": [],
        "decode": [],
        "prefill": [],
        "notes": [],
    }
    if threads is not None:
        env["threads"] = threads
        say(f"threads: {threads} intra-op ({threads_from})")

    after_decode = None
    if tokenizer is not None:
        eager_texts = real_model.generate(model, tokenizer, max_new_tokens=GENERATED_TOKENS)
        results["generations"] = []

        def after_decode(runner: Any, label: str) -> None:
            rows = real_model.generation_rows(
                model, tokenizer, runner, label, eager_texts, max_new_tokens=GENERATED_TOKENS
            )
            results["generations"].extend(rows)
            say(real_model.format_generations(rows, GENERATED_TOKENS))

    decode_table = (
        ["batch", *TIMING_HEADERS, "replayed", "prepare us", "tokens match", "max |diff|", "within tol"]
        + (["HF match"] if reference_logits is not None else []),
        lambda r: (
            [
                r["batch_size"],
                r["eager_ms"],
                r.get("graph_ms"),
                _speedup(r),
                _speedup_range(r),
                r.get("replayed"),
                r.get("replay_prepare_us"),
                r.get("tokens_match"),
                r.get("max_abs_diff"),
                r.get("within_tolerance"),
            ]
            + ([r.get("hf_match")] if reference_logits is not None else [])
        ),
    )
    failed = _bench_phase(
        "decode",
        plans["decode"],
        model,
        device,
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
            rounds=rounds,
            reference_logits=reference_logits,
        ),
        say,
        after_decode,
    )
    if not args.no_prefill:
        max_reqs = max(args.prefill_requests) + 1
        model.create_kv_cache(num_slots=max_reqs * max_tokens + 1, max_reqs=max_reqs, max_context_len=max_tokens)
        prefill_table = (
            [
                "tokens",
                "requests",
                *TIMING_HEADERS,
                "replayed",
                "argmax match",
                "max |diff|",
                "within tol",
            ]
            + (["HF match"] if reference_logits is not None else []),
            lambda r: (
                [
                    r["num_tokens"],
                    r["requests"],
                    r["eager_ms"],
                    r.get("graph_ms"),
                    _speedup(r),
                    _speedup_range(r),
                    r.get("replayed"),
                    r.get("argmax_match"),
                    r.get("max_abs_diff"),
                    r.get("within_tolerance"),
                ]
                + ([r.get("hf_match")] if reference_logits is not None else [])
            ),
        )
        failed |= _bench_phase(
            "prefill",
            plans["prefill"],
            model,
            device,
            results,
            prefill_table,
            lambda runner: bench_prefill(
                model,
                runner,
                token_counts=token_counts,
                requests=args.prefill_requests,
                iters=iters,
                warmup=args.warmup,
                rounds=rounds,
                reference_logits=reference_logits,
            ),
            say,
        )

    busy = busy_note(results["decode"] + results["prefill"])
    if busy:
        say(f"\nnote: {busy}")
        results["notes"].append(busy)
    document = results_document(results)
    if args.json_path and (tp is None or tp.rank == 0):
        with open(args.json_path, "w") as f:
            json.dump(document, f, indent=2)
        say(f"\nwrote {args.json_path}")
    if getattr(args, "plot_path", None) and (tp is None or tp.rank == 0):
        from ..plot import plot_results

        plot_results(document, args.plot_path)
        say(f"wrote {args.plot_path}")
    if fmt == "json":
        print(json.dumps(document, indent=2))
    elif fmt == "csv":
        sys.stdout.write(results_csv(document))
    if failed:
        print(
            "\nerror: a graph result differs from eager by more than its backend's tolerance "
            "(the 'within tol' column); see the tables",
            file=sys.stderr,
        )
    return 1 if failed else 0
