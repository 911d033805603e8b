#!/usr/bin/env python3
"""Side-by-side benchmarks on one GPU, in one run: what a user picking a graph runner needs.

For each model preset (bfloat16, random weights; shapes of Llama-3.2-1B and Qwen2.5-0.5B):

* decode step latency (ms) per batch size for: eager; a hand-written single
  ``torch.cuda.CUDAGraph`` per batch size (copy the live inputs into its static tensors,
  replay: the floor for any runner's overhead); ``torch.compile(mode="reduce-overhead")``
  (CUDA-graph trees; at a few batch sizes, compile time is long); and every installed
  graph backend through ``DecodeCudaGraphRunner``;
* the ratio of every backend to the hand-written graph and to reduce-overhead, measured
  in this run (what ``benchmarks/compare.py`` checks against the stored baseline);
* capture seconds and graph memory for the default decode size list (up to 256), and
  the memory of the largest size alone (the pool-sharing ratio; not with ``--quick``);
* host-side time of ``replay_prepare`` (µs, median);
* prefill latency (ms) over token counts, each split over every ``--prefill-requests``
  count of requests (``1 4``: one request, then four), eager vs each prefill-capable
  backend;
* the floor of each decode size and prefill token count (CUDA; ``floor_ms``, a column
  of the tables with each method's time over it): decode, the bytes a step reads
  (weights, K/V) over the copy bandwidth measured in the run; prefill, its FLOPs over the
  bf16 GEMM rate measured in the run (:mod:`floors`; the rates in ``device_rates``).

How the numbers are made to hold from run to run (docs/benchmarks.md says why):

1. Everything is built before anything is timed: every hand-written graph, every
   reduce-overhead compile, every backend's compile and capture (inductor's kernels and
   their autotuning happen here, not inside a timed block).
2. Inductor's run-time choices that depend on timing are pinned (``--inductor-config
   pinned``, the default): one kernel config per pointwise kernel and one filtered config
   per reduction, chosen by heuristics instead of by a benchmark that a busy fresh machine
   can bias; no max-autotune, no coordinate descent.
3. The garbage collector is collected and frozen before timing (as the runners do around
   capture; sglang's ``freeze_gc``), and the time it still spends is reported (``gc_ms``).
4. Timing is in rounds (``bench_rounds.run_rounds``): each round times every method once
   (a block of ``--iters`` calls between two device synchronizes), in an order rotated
   every round, so a drift of the machine hits all methods alike; warm-up rounds repeat
   until every method's time changes by less than 2% (median of 3 rounds vs the 3 before,
   at most ``--warmup-max`` rounds) and for at least ``--warmup-min-s`` seconds (a fresh
   machine showed a flat but slow first few seconds), then ``--rounds`` rounds are
   measured; a host-speed probe after every round is kept (``host_probe_us``). Each cell
   reports median, min and max over the measured rounds, and ratios pair round with round.
5. ``--pin-cpu`` pins the process to the given CPUs while timing (host-bound backends
   suffer most from a busy host); the GPU's SM clock, throttle reasons and the host load
   are recorded before and after timing.

Results go to ``OUT/benchmarks.json`` in the shared results schema
(:mod:`cuda_graph_runner.cli.results_schema`, which ``cuda-graph-runner bench --json`` writes
too; rewritten after every section, so a cut-short run
keeps what it measured) and ``OUT/benchmarks.md`` (``make_docs.render``).

Isolation (``--isolate``, the default with ``--device cuda``; ``--no-isolate`` turns it off):
each method that compiles (``full+torch_compile``, ``tc_piecewise``, ``tc_piecewise:inductor``,
reduce-overhead) runs in a fresh process of this script, beside its own eager run and
hand-written graph, and the rows are merged into one JSON (:mod:`isolated`: which rows come
from where, and how a ratio to reduce-overhead is chained through the hand graph). In one
process, what the others compiled moved tc_piecewise:inductor's ratio to the hand graph by
up to 1.3x (``benchmarks/isolation_ab.py`` measures it).

``--device cpu`` is a smoke test of the harness only (the tiny preset, float32, no CUDA
graphs: ``hand_graph`` then copies the inputs and runs eagerly); its numbers mean nothing.
``--inject-sleep-ms BACKEND=MS`` is test-only: it adds a host sleep after every call of
that method, to show that ``compare.py`` flags a slowed backend.

Usage (device machine, after ``scripts/gpu_check.sh`` installed the packages)::

    python benchmarks/run.py --out $OUT
    python benchmarks/run.py --out /tmp/b --models llama-3.2-1b --batch-sizes 1 32 128 --quick --prefill-tokens
    python benchmarks/run.py --device cpu --models tiny --batch-sizes 1 4 --quick --prefill-tokens --out /tmp/smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rounds import run_rounds  # noqa: E402
from bench_summary import ratios_for  # noqa: E402
from floors import decode_floor_ms, measure_rates, prefill_floor_ms  # noqa: E402
from isolated import child_argv, dir_name, groups, merge  # noqa: E402
from make_docs import render  # noqa: E402
from portable import portable_argv, portable_path  # noqa: E402

from cuda_graph_runner.backend.context import forward_context  # noqa: E402
from cuda_graph_runner.backend.errors import CudaGraphRunnerError  # noqa: E402
from cuda_graph_runner.backend.forward_batch import ForwardBatch, as_static_batch  # noqa: E402
from cuda_graph_runner.backend.options import option_readers  # noqa: E402
from cuda_graph_runner.backend.pool import graph_owned_cublas_workspace  # noqa: E402
from cuda_graph_runner.cli.bench.args import attention_arg  # noqa: E402
from cuda_graph_runner.cli.bench.backends import label_of, label_options, parse_label, takes_compile_sizes  # noqa: E402
from cuda_graph_runner.cli.results_schema import ResultsSchemaError, from_run_models, nested_view, read  # noqa: E402
from cuda_graph_runner.config import CudaGraphConfigError  # noqa: E402
from cuda_graph_runner.config.flags import FlattenSizes, sizes_arg  # noqa: E402
from cuda_graph_runner.config.integers import count_arg  # noqa: E402
from cuda_graph_runner.reference.batches import GreedySession, make_decode_batch, make_dummy_prompts, make_extend_batch  # noqa: E402
from cuda_graph_runner.reference.model import (  # noqa: E402
    DEFAULT_ATTENTION,
    ReferenceLlamaForCausalLM,
    make_attention_backend,
)
from cuda_graph_runner.registry import get_registry  # noqa: E402
from cuda_graph_runner.runner import DecodeCudaGraphRunner  # noqa: E402

DECODE_BS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PREFILL_TOKENS = [128, 512, 2048]


def _model_forward(model: Any, batch: ForwardBatch) -> torch.Tensor:
    # The class's forward, not ``model.forward``: tc_piecewise installs a trampoline as the
    # instance's forward while its runner lives; eager and the baselines must not pass through it.
    return type(model).forward(model, batch)


class HandWrittenGraph:
    """One ``torch.cuda.CUDAGraph`` for exactly one batch size, no runner in between.

    Its ``__call__`` copies the live batch's five inputs into its static tensors and
    replays: the least any integration can do per step. With a plan-based attention it
    also runs the model's capture hook before the warm-ups and its replay hook (the same
    re-plan the runner runs) before every replay, on a static batch. ``use_graph=False``
    (the CPU smoke test only) runs the model eagerly on the static tensors instead.
    """

    FIELDS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens")

    def __init__(self, model: Any, batch: ForwardBatch, pool: Any, use_graph: bool = True) -> None:
        static = {f: getattr(batch, f).clone() for f in self.FIELDS}
        self.plan_replay = getattr(model, "init_forward_metadata_replay", None)
        if self.plan_replay is not None:
            self.static: ForwardBatch = as_static_batch(batch, **static)
            model.init_forward_metadata_capture(self.static)
        else:
            self.static = batch.replace(**static)
        self.model = model
        self.graph: Any = None
        fn = lambda: model.compute_logits(_model_forward(model, self.static), self.static)  # noqa: E731
        self.fn = fn
        if not use_graph:
            return
        stream = torch.cuda.Stream()
        with forward_context(self.static):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            # The graph's cuBLAS workspace in its pool, as the runners do (pool.py).
            with graph_owned_cublas_workspace(torch.cuda.graph(self.graph, pool=pool, stream=stream), torch.cuda):
                self.out = fn()

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        for f in self.FIELDS:
            getattr(self.static, f).copy_(getattr(batch, f), non_blocking=True)
        if self.plan_replay is not None:
            self.static.seq_lens_cpu = batch.seq_lens_cpu
            self.plan_replay(self.static)
        if self.graph is None:
            with forward_context(self.static):
                return self.fn()
        self.graph.replay()
        return self.out


def reduce_overhead_fn(
    model: Any, batch: ForwardBatch, backend: Optional[str] = None
) -> Callable[[ForwardBatch], torch.Tensor]:
    """``torch.compile(mode="reduce-overhead", dynamic=False)`` over the model for one batch size.

    The marked attention op reads metadata through the forward context, which Dynamo
    does not see, so the compiled function always runs on the same static tensors
    (live values copied in) to keep the addresses the captured graph reads.
    ``dynamic=False``: each batch size gets its own static entry (no reset between sizes,
    so all of them stay alive for the interleaved rounds). ``backend`` (e.g. ``"eager"``,
    the CPU smoke of ``isolation_ab.py``) compiles with that Dynamo backend instead of
    inductor's reduce-overhead mode.
    """
    static = batch.replace(**{f: getattr(batch, f).clone() for f in HandWrittenGraph.FIELDS})
    # CUDA-graph trees skip graphs that mutate non-static inputs; the KV cache and the
    # static inputs keep their addresses, so say so (as an engine integrating it would).
    cache = model.kv_cache
    for t in [
        *cache.k_buffers,
        *cache.v_buffers,
        cache.req_to_token,
        *(getattr(static, f) for f in HandWrittenGraph.FIELDS),
    ]:
        torch._dynamo.mark_static_address(t)

    def step(b: ForwardBatch) -> torch.Tensor:
        return model.compute_logits(_model_forward(model, b), b)

    if backend is None:
        compiled = torch.compile(step, mode="reduce-overhead", fullgraph=False, dynamic=False)
    else:
        compiled = torch.compile(step, backend=backend, fullgraph=False, dynamic=False)

    def call(live: ForwardBatch) -> torch.Tensor:
        for f in HandWrittenGraph.FIELDS:
            getattr(static, f).copy_(getattr(live, f), non_blocking=True)
        with forward_context(static):
            return compiled(static)

    call.compiled = compiled  # type: ignore[attr-defined]  # its code object's Dynamo entries, for probes
    return call


def eager_fn(model: Any) -> Callable[[ForwardBatch], torch.Tensor]:
    # A plan-based attention plans every eager forward (the model's hook is None for torch).
    plan = getattr(model, "init_forward_metadata", None)

    def call(b: ForwardBatch) -> torch.Tensor:
        if plan is not None:
            plan(b)
        with forward_context(b):
            return model.compute_logits(_model_forward(model, b), b)

    return call


def available(phase: str, names: Sequence[str]) -> Dict[str, str]:
    """``{name: ""}`` for usable backends, ``{name: reason}`` for the others."""
    out = {}
    reg = get_registry()
    for name in names:
        try:
            reg.get(phase_options(name)["backend"], device_type="cuda", phase=phase)
            out[name] = ""
        except CudaGraphRunnerError as exc:
            out[name] = str(exc)
    return out


def phase_options(label: str, compile_sizes: Sequence[int] = ()) -> Dict[str, Any]:
    """``"tc_piecewise:inductor"`` -> ``{"backend": "tc_piecewise", "tc_compiler": "inductor"}``,
    ``"full+torch_compile"`` -> ``{"backend": "full", "torch_compile": True, ...}`` (every
    size compiled; the deprecated ``full:inductor`` reads as it, with a warning);
    ``compile_sizes`` (``--compile-sizes``) go to the labels that use them, by the rule of
    ``cuda-graph-runner bench`` (:func:`~cuda_graph_runner.cli.bench.backends.takes_compile_sizes`)."""
    name, compiler = parse_label(label)
    options: Dict[str, Any] = {"backend": name, **label_options(compiler, None, None)}
    if compile_sizes and takes_compile_sizes(name, compiler, option_readers(get_registry())):
        options["compile_sizes"] = sorted(compile_sizes)
    return options


def fresh_backend(phase: str, label: str, compile_sizes: Sequence[int] = ()) -> Any:
    """Backend ``label`` (see :func:`phase_options`) capturing into a pool of its own."""
    return get_registry().resolve(
        phase, phase_options(label, compile_sizes), device="cuda", memory_pool=torch.cuda.graph_pool_handle()
    )


# -- pinning the causes of run-to-run drift -------------------------------------------------


def pin_inductor(mode: str) -> Dict[str, Any]:
    """Make inductor's kernel choices independent of timing (``mode="pinned"``); returns
    the settings applied (recorded in the JSON). ``"default"`` leaves inductor alone.

    By default inductor benchmarks several Triton configs of a pointwise or reduction
    kernel at its first call and keeps the fastest (``CachingAutotuner``); on a fresh,
    busy machine that benchmark can pick another config than on a quiet one, and the
    choice is cached on disk. Pinned: heuristics pick one config
    (``triton.autotune_pointwise=False``, ``test_configs.force_filter_reduction_configs=True``),
    and neither max-autotune nor coordinate-descent tuning runs.
    """
    if mode == "default":
        return {"mode": "default"}
    import torch._inductor.config as ic

    # force_filter_reduction_configs: the heuristic filter inductor's deterministic mode uses
    # (torch/_inductor/runtime/triton_heuristics.py), without the rest of that mode.
    wanted = {
        "max_autotune": False,
        "max_autotune_pointwise": False,
        "max_autotune_gemm": False,
        "coordinate_descent_tuning": False,
        "triton.autotune_pointwise": False,
        "test_configs.force_filter_reduction_configs": True,
    }
    applied: Dict[str, Any] = {"mode": "pinned"}
    for key, value in wanted.items():
        owner, _, attr = key.rpartition(".")
        obj = getattr(ic, owner, None) if owner else ic
        if obj is not None and hasattr(obj, attr):  # names move between torch versions: set what exists
            setattr(obj, attr, value)
            applied[key] = value
        else:
            applied[key] = "not in this torch"
    return applied


def inductor_cache_state() -> Dict[str, Any]:
    """Where inductor's on-disk cache is and whether it held anything when the run began
    (a cold cache is what a fresh machine's first run has)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        path = cache_dir()
    except Exception:  # older torch: the documented default
        path = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or f"/tmp/torchinductor_{os.environ.get('USER', 'root')}"
    try:
        entries = len(os.listdir(path))
    except OSError:
        entries = 0
    return {"dir": portable_path(path), "entries_at_start": entries, "warm": entries > 0}


def gpu_state() -> Dict[str, Any]:
    """SM clock (MHz) and more from NVML/nvidia-smi, each field None where not available."""
    state: Dict[str, Any] = {
        "time": time.time(),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if not torch.cuda.is_available():
        return state
    try:
        state["clock_rate_mhz"] = torch.cuda.clock_rate()
    except Exception as exc:  # needs pynvml
        state["clock_rate_mhz"] = None
        state["clock_rate_error"] = f"{type(exc).__name__}: {exc}"[:200]
    # clocks_throttle_reasons.active: a bit mask, 0 = nothing holds the clock down (power, thermal, ...).
    fields = "clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active"
    try:
        proc = subprocess.run(
            [
                "nvidia-smi",
                f"--query-gpu={fields}",
                "--format=csv,noheader,nounits",
                f"--id={torch.cuda.current_device()}",
            ],
            capture_output=True,
            text=True,
            timeout=15,
            check=False,
        )
        out = proc.stdout.strip()
        if proc.returncode == 0 and out:
            state["nvidia_smi"] = dict(zip(fields.split(","), [v.strip() for v in out.split(",")]))
        else:
            state["nvidia_smi"] = None
            state["nvidia_smi_error"] = (out or proc.stderr.strip())[:200]
    except (OSError, subprocess.SubprocessError) as exc:
        state["nvidia_smi"] = None
        state["nvidia_smi_error"] = f"{type(exc).__name__}: {exc}"[:200]
    return state


def parse_cpus(spec: str) -> List[int]:
    """``"3"``, ``"2,3"``, ``"2-5"`` or ``"auto"`` (the last CPU this process may use, away
    from CPU 0, which takes most interrupts) -> CPU ids.

    Raises:
        argparse.ArgumentTypeError: malformed spec (names it and the accepted forms).
    """
    if spec == "auto":
        allowed = sorted(os.sched_getaffinity(0))
        return [allowed[-1]]
    cpus: List[int] = []
    try:
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            cpus += list(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--pin-cpu {spec!r}: expected 'auto', N, N,M or N-M") from None
    if not cpus:
        raise argparse.ArgumentTypeError(f"--pin-cpu {spec!r}: no CPU named")
    return cpus


def parse_sleep(spec: str) -> tuple:
    """``"breakable=0.5"`` -> ``("breakable", 0.5)`` (ms); test-only (see the module docstring)."""
    name, sep, ms = spec.rpartition("=")
    try:
        value = float(ms)
    except ValueError:
        value = -1.0
    if not sep or not name or value < 0:
        raise argparse.ArgumentTypeError(
            f"--inject-sleep-ms {spec!r}: expected METHOD=MS with MS >= 0, e.g. breakable=0.5"
        )
    return name, value


def with_sleep(fn: Callable[[], Any], ms: float, sync: Callable[[], None]) -> Callable[[], Any]:
    """``fn``, a device synchronize, then a host sleep of ``ms`` milliseconds (the
    deliberately slowed backend). The synchronize keeps the sleep from hiding behind
    queued device work, so every batch size slows by at least ``ms`` per step."""

    def slowed() -> Any:
        out = fn()
        sync()
        time.sleep(ms / 1000.0)
        return out

    return slowed


class Pinned:
    """Context manager: the calling (main, kernel-launching) thread runs on ``cpus`` inside,
    on its old CPU set after. Only while timing: compile workers spawned earlier keep all
    CPUs (pinned at compile time, a cold inductor compile would crawl on one core)."""

    def __init__(self, cpus: Optional[List[int]]) -> None:
        self.cpus = cpus
        self.old: Optional[set] = None

    def __enter__(self) -> "Pinned":
        if self.cpus:
            self.old = os.sched_getaffinity(0)
            os.sched_setaffinity(0, self.cpus)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.old is not None:
            os.sched_setaffinity(0, self.old)


# -- results ---------------------------------------------------------------------------------


class Results:
    def __init__(self, out_dir: str, env: Dict[str, Any], settings: Dict[str, Any]) -> None:
        self.path = os.path.join(out_dir, "benchmarks.json")
        self.md_path = os.path.join(out_dir, "benchmarks.md")
        self.used_sleep: set = set()  # methods that got the test-only --inject-sleep-ms
        # Built as per-model tables while running; written in the shared results schema.
        self.data: Dict[str, Any] = {
            "env": env,
            "settings": settings,
            "models": {},
            "notes": [],
            "host_probe_us": {},
        }

    def model(self, name: str) -> Dict[str, Any]:
        return self.data["models"].setdefault(
            name, {"decode": {}, "ratios": {}, "prefill": {}, "capture": {}, "replay_prepare_us": {}}
        )

    def note(self, text: str) -> None:
        print(f"note: {text}", flush=True)
        self.data["notes"].append(text)

    def document(self) -> Dict[str, Any]:
        """The results so far as a :mod:`cuda_graph_runner.cli.results_schema` document."""
        d = self.data
        return from_run_models(
            d["models"], d["env"], settings=d["settings"], notes=d["notes"], host_probe_us=d["host_probe_us"]
        )

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.document(), f, indent=2)
        os.replace(tmp, self.path)
        with open(self.md_path, "w") as f:
            f.write(render(self.data))


def decode_batches(model: Any, batch_sizes: Sequence[int], prompt_len: int) -> Dict[int, ForwardBatch]:
    """One live decode batch per size, prompts prefilled eagerly (their KV in the cache)."""
    batches = {}
    for bs in batch_sizes:
        session = GreedySession(model, model.kv_cache)
        with torch.no_grad():
            session.prefill(make_dummy_prompts(bs, prompt_len, model.config.vocab_size, seed=bs))
        batches[bs] = make_decode_batch(model.kv_cache, session.rows, None, [t[-1] for t in session.tokens])
    return batches


def host_probe_us() -> float:
    """Microseconds a fixed pure-Python loop takes now: a host-speed sample (CPU clocks,
    contention), independent of the GPU."""
    start = time.perf_counter()
    total = 0
    for i in range(20000):
        total += i
    return (time.perf_counter() - start) * 1e6


class Timer:
    """Runs the rounds of one size with the run's settings (sleep injection, pinning, GC)."""

    def __init__(self, args: argparse.Namespace, device: str, results: Results) -> None:
        self.args = args
        self.sync: Callable[[], None] = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        self.results = results
        self.sleep = dict(args.inject_sleep_ms or [])

    def time(self, label: str, methods: Dict[str, Callable[[], Any]]) -> Dict[str, Dict[str, Any]]:
        """``{method: cell}`` (see ``bench_rounds.CellTimes.summary``) for one size; ``label``
        names it in notes."""
        fns = {}
        for name, fn in methods.items():
            if name in self.sleep:
                fns[name] = with_sleep(fn, self.sleep[name], self.sync)
                self.results.used_sleep.add(name)
            else:
                fns[name] = fn
        a = self.args
        probes: List[float] = []

        def between_rounds() -> None:
            self.sync()
            probes.append(host_probe_us())

        gc.collect()
        if a.gc_freeze:
            gc.freeze()
        try:
            with Pinned(a.pin_cpu), torch.no_grad():
                # Eager need not settle: it is no reference (bound by the host's launch rate,
                # it wanders) and waiting for it would run every warm-up to the cap.
                cells = run_rounds(
                    fns,
                    iters=a.iters,
                    rounds=a.rounds,
                    sync=self.sync,
                    warmup_min=a.warmup_min,
                    warmup_max=a.warmup_max,
                    tol=a.warmup_tol,
                    warmup_min_s=a.warmup_min_s,
                    between_rounds=between_rounds,
                    must_settle=[n for n in fns if n != "eager"],
                )
        finally:
            if a.gc_freeze:
                gc.unfreeze()
        out = {name: cell.summary() for name, cell in cells.items()}
        # One host-speed sample per round (warm-up and measured): tells a slow host (clocks,
        # contention) from a slow device path when a round is slow.
        self.results.data["host_probe_us"][label] = [round(x, 1) for x in probes]
        unsteady = [n for n, c in out.items() if not c["steady"] and n != "eager"]
        if unsteady:
            self.results.note(
                f"{label}: warm-up hit --warmup-max={a.warmup_max} before {', '.join(unsteady)} settled "
                f"(2% rule); their numbers may include a cold start"
            )
        return out


def run_model(name: str, args: argparse.Namespace, results: Results, device: str) -> None:
    m = results.model(name)
    on_cuda = device == "cuda"
    dtype = torch.bfloat16 if on_cuda else torch.float32
    model = ReferenceLlamaForCausalLM.from_preset(name, dtype=dtype, device=device, attention=args.attention)
    # torch.compile's reduce-overhead records the model without the metadata hooks: only an
    # attention that plans nothing can be timed there (the hand-written graph runs the hooks).
    baselines = not model.attn_backend.plans
    if not baselines:
        results.note(f"{name}: attention {args.attention} plans on the host: reduce_overhead not timed")
    bs_list = sorted(args.batch_sizes)
    context = args.prompt_len + 16
    max_reqs = sum(bs_list) + 2
    model.create_kv_cache(num_slots=max_reqs * context + 1, max_reqs=max_reqs, max_context_len=context)
    batches = decode_batches(model, bs_list, args.prompt_len)
    pool = torch.cuda.graph_pool_handle() if on_cuda else None
    eager = eager_fn(model)
    timer = Timer(args, device, results)
    methods: Dict[int, Dict[str, Callable[[], Any]]] = {bs: {} for bs in bs_list}

    with torch.no_grad():
        # 1. Build everything before timing anything.
        for bs in bs_list:
            b = batches[bs]
            methods[bs]["eager"] = lambda b=b: eager(b)
            hand = HandWrittenGraph(model, b, pool, use_graph=on_cuda)  # a plan-based attention re-plans each replay
            methods[bs]["hand_graph"] = lambda b=b, hand=hand: hand(b)

        if not args.quick and on_cuda and baselines:
            torch._dynamo.reset()  # once, before any backend: a reset later would drop tc_piecewise's compiled code
            for bs in [b for b in args.reduce_overhead_bs if b in batches]:
                start = time.perf_counter()
                try:
                    fn = reduce_overhead_fn(model, batches[bs])
                    for _ in range(3):
                        fn(batches[bs])
                    methods[bs]["reduce_overhead"] = lambda fn=fn, b=batches[bs]: fn(b)
                    results.note(
                        f"{name}: torch.compile reduce-overhead at bs={bs} compiled in {time.perf_counter() - start:.1f} s"
                    )
                except Exception as exc:  # a baseline failing must not stop the suite
                    results.note(
                        f"{name}: torch.compile reduce-overhead failed at bs={bs}: {type(exc).__name__}: {exc}"
                    )

        runners: Dict[str, Any] = {}
        backends = (
            available("decode", args.backends)
            if on_cuda
            else {b: "--device cpu: graph backends are not timed (smoke test)" for b in args.backends}
        )
        for backend, reason in backends.items():
            if reason:
                results.note(f"{name}: decode backend {backend} skipped: {reason}")
                continue
            runner = None
            try:
                # A fresh pool per backend, so one backend's leftovers never hide another's memory.
                runner = DecodeCudaGraphRunner(
                    model,
                    {"decode": {**phase_options(backend, args.compile_sizes), "max_bs": max(256, max(bs_list))}},
                    show_progress=False,
                    backend=fresh_backend("decode", backend, args.compile_sizes),
                )
                runner.capture()
                cap = {
                    "sizes": len(runner.capture_sizes),
                    "capture_s": runner.capture_seconds,
                    "pool_mb": (runner.capture_memory_bytes or 0) / 2**20,
                    "warmup": runner.backend.warmup_policy,
                }
                if getattr(runner.backend, "compile_seconds", None) is not None:
                    cap["compile_s"] = runner.backend.compile_seconds
                diffs = {
                    str(bs): float((runner.forward(batches[bs]).float() - eager(batches[bs]).float()).abs().max())
                    for bs in bs_list
                }
            except Exception as exc:
                results.note(f"{name}: decode backend {backend} failed: {type(exc).__name__}: {exc}")
                if runner is not None:
                    try:
                        runner.cleanup()
                    except Exception:  # the failure above is what the note reports
                        pass
                continue
            # Only a backend that captured and ran every size is timed (never half a row).
            m["capture"][backend] = cap
            m.setdefault("max_abs_diff_vs_eager", {})[backend] = diffs
            for bs in bs_list:
                methods[bs][backend] = lambda b=batches[bs], runner=runner: runner.forward(b)
            runners[backend] = runner
        if on_cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        results.save()

        # 2. Time: interleaved rounds per batch size.
        m["gpu_before_timing"] = gpu_state()
        # How much a collection would have to walk: a cold inductor compile leaves a far
        # bigger heap than a warm one (the suspect of the first-run slow mode).
        m["python_objects_before_timing"] = len(gc.get_objects())
        for bs in bs_list:
            m["decode"][str(bs)] = timer.time(f"{name} decode bs={bs}", methods[bs])
            print(
                f"{name} bs={bs}: "
                + ", ".join(
                    f"{k} {c['median_ms']:.3f} [{c['min_ms']:.3f}-{c['max_ms']:.3f}]"
                    for k, c in m["decode"][str(bs)].items()
                ),
                flush=True,
            )
            m["ratios"] = ratios_for(m["decode"])
            results.save()
        m["gpu_after_timing"] = gpu_state()
        if on_cuda:  # measured after the timed rounds, beside the table (not a timed method)
            rates = rates_of(m)
            for bs in bs_list:
                floor = decode_floor_ms(model, bs, args.prompt_len + 1, rates)
                m.setdefault("floor_ms", {}).setdefault("decode", {})[str(bs)] = floor
                print(f"{name} bs={bs}: floor {floor:.3f} ms (bytes / {rates.copy_gbps:.0f} GB/s)", flush=True)
            results.save()

        # 3. What needs no steady timing: host-side replay_prepare, then the memory of the largest size alone.
        for backend, runner in runners.items():
            calls = getattr(runner.backend, "piece_calls", None)
            if callable(calls):  # tc_piecewise: did every piece replay its graph?
                m["capture"][backend]["piece_calls"] = calls()
                m["capture"][backend]["dynamo_compiles"] = getattr(runner.backend, "dynamo_compiles", None)
            b = batches[bs_list[0]]
            samples = []
            for _ in range(200):
                start = time.perf_counter()
                runner.replay_prepare(b)
                samples.append((time.perf_counter() - start) * 1e6)
            torch.cuda.synchronize()
            m["replay_prepare_us"][backend] = statistics.median(samples)
        for backend in list(runners):
            runners.pop(backend).cleanup()
        methods.clear()
        if on_cuda:
            torch.cuda.empty_cache()
        if not args.quick and on_cuda:
            for backend in [b for b in m["capture"] if b in args.backends]:
                try:
                    alone = DecodeCudaGraphRunner(
                        model,
                        {"decode": {**phase_options(backend), "bs": [256], "max_bs": 256}},
                        show_progress=False,
                        backend=fresh_backend("decode", backend),
                    )
                    alone.capture()
                    cap = m["capture"][backend]
                    cap["largest_alone_mb"] = (alone.capture_memory_bytes or 0) / 2**20
                    if cap["largest_alone_mb"]:
                        cap["pool_ratio"] = cap["pool_mb"] / cap["largest_alone_mb"]
                    alone.cleanup()
                    del alone
                except Exception as exc:
                    results.note(
                        f"{name}: decode backend {backend} (largest size alone) failed: {type(exc).__name__}: {exc}"
                    )
                torch.cuda.empty_cache()
        results.save()

        if args.prefill_tokens:
            run_prefill(name, model, args, results, timer, eager, on_cuda)
    del model
    if on_cuda:
        torch.cuda.empty_cache()


def prefill_lengths(tokens: int, requests: int) -> List[int]:
    """``tokens`` split over ``requests`` requests (at most ``tokens``) as evenly as can
    be, the first ones one longer."""
    return [tokens // requests + (1 if i < tokens % requests else 0) for i in range(requests)]


def prefill_section(m: Dict[str, Any], requests: int) -> Dict[str, Any]:
    """Where the prefill cells of ``requests`` requests per batch go in a model's tables:
    ``m["prefill"]`` for the first request count of the run (``m["prefill_requests"]``),
    ``m["prefill_by_requests"][R]`` for the others (the same ``{TOKENS: {METHOD: cell}}``)."""
    if m.setdefault("prefill_requests", requests) == requests:
        return m["prefill"]
    return m.setdefault("prefill_by_requests", {}).setdefault(str(requests), {})


def run_prefill(
    name: str,
    model: Any,
    args: argparse.Namespace,
    results: Results,
    timer: Timer,
    eager: Callable[[ForwardBatch], torch.Tensor],
    on_cuda: bool,
) -> None:
    from cuda_graph_runner.runner import PrefillCudaGraphRunner

    m = results.model(name)
    max_tokens = max(args.prefill_tokens)
    counts = list(dict.fromkeys(args.prefill_requests))  # in the given order, once each
    # Every batch (token count x request count) alive at once, in one cache, so one set
    # of runners serves them all (re-running a batch rewrites its own slots only).
    cases = [(t, r) for r in counts for t in args.prefill_tokens]
    lengths = {case: prefill_lengths(*case) for case in cases}
    model.create_kv_cache(
        num_slots=sum(args.prefill_tokens) * len(counts) + 1,
        max_reqs=sum(len(x) for x in lengths.values()) + 1,
        max_context_len=max(max(x) for x in lengths.values()) + 1,
    )
    batches = {}
    methods: Dict[Any, Dict[str, Callable[[], Any]]] = {}
    for case in cases:
        prompts = make_dummy_prompts(len(lengths[case]), lengths[case], model.config.vocab_size)
        batches[case] = make_extend_batch(model.kv_cache, prompts)
        methods[case] = {"eager": lambda b=batches[case]: eager(b)}
    runners = []
    backends = available("prefill", args.backends) if on_cuda else {b: "--device cpu" for b in args.backends}
    for backend, reason in backends.items():
        if reason:
            results.note(f"{name}: prefill backend {backend} skipped: {reason}")
            continue
        try:
            try:
                runner = PrefillCudaGraphRunner(
                    model,
                    # Request slots (prefill full; the others ignore the key): the most requests of a batch.
                    {"prefill": {**phase_options(backend), "max_bs": max_tokens, "full_prefill_max_req": max(counts)}},
                    show_progress=False,
                    backend=fresh_backend("prefill", backend),
                )
            except CudaGraphConfigError as exc:
                # The runner's own refusal (prefill full with an attention that re-plans no prefill graph).
                if exc.key != "backend":
                    raise
                results.note(f"{name}: prefill backend {backend} skipped: {exc}")
                continue
            runner.capture()
            m["capture"][f"{backend} (prefill)"] = {
                "sizes": len(runner.capture_sizes),
                "capture_s": runner.capture_seconds,
                "pool_mb": (runner.capture_memory_bytes or 0) / 2**20,
            }
            for case, b in batches.items():
                methods[case][backend] = lambda b=b, runner=runner: runner.forward(b)
            runners.append(runner)
        except Exception as exc:
            results.note(f"{name}: prefill backend {backend} failed: {type(exc).__name__}: {exc}")
    for t, r in cases:
        cells = timer.time(f"{name} prefill {t} tokens, {r} requests", methods[(t, r)])
        for cell in cells.values():
            cell["requests"] = r
        prefill_section(m, r)[str(t)] = cells
        if on_cuda:
            rates = rates_of(m)
            floor = prefill_floor_ms(model, lengths[(t, r)], rates)
            floors = m.setdefault("floor_ms", {})
            if r == m["prefill_requests"]:
                floors.setdefault("prefill", {})[str(t)] = floor
            else:
                floors.setdefault("prefill_by_requests", {}).setdefault(str(r), {})[str(t)] = floor
            print(
                f"{name} prefill {t} tokens, {r} requests: floor {floor:.3f} ms "
                f"(FLOPs / {rates.gemm_tflops:.0f} TFLOP/s)",
                flush=True,
            )
        results.save()
    for runner in runners:
        runner.cleanup()


def rates_of(m: Dict[str, Any]) -> Any:
    """The device's copy bandwidth and GEMM rate, measured once per model section."""
    from floors import DeviceRates

    if "device_rates" not in m:
        m["device_rates"] = dataclasses.asdict(measure_rates())
    return DeviceRates(**m["device_rates"])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"), help="output folder (default $OUT or ./out)")
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu: smoke test of the harness only (no graphs, numbers mean nothing)",
    )
    parser.add_argument(
        "--models", nargs="+", default=None, help="presets (default llama-3.2-1b qwen2.5-0.5b; tiny with --device cpu)"
    )
    parser.add_argument(
        "--batch-sizes",
        type=sizes_arg,
        action=FlattenSizes,
        nargs="+",
        default=DECODE_BS,
        help="space or comma separated",
    )
    parser.add_argument(
        "--backends",
        default="full,breakable,tc_piecewise,tc_piecewise:inductor",
        help="comma-separated backends (name[:tc_compiler], or full+torch_compile for compiled full) to "
        "bench where installed and usable",
    )
    parser.add_argument(
        "--reduce-overhead-bs",
        type=sizes_arg,
        action=FlattenSizes,
        nargs="*",
        default=[1, 32],
        help="batch sizes for the torch.compile reduce-overhead baseline (slow to compile)",
    )
    parser.add_argument(
        "--compile-sizes",
        type=sizes_arg,
        action=FlattenSizes,
        nargs="*",
        default=[],
        help="decode batch sizes that compiled full (full+torch_compile) compiles with static shapes, e.g. the "
        "--reduce-overhead-bs sizes (default: none, one dynamic-shape graph)",
    )
    parser.add_argument(
        "--prefill-tokens",
        type=sizes_arg,
        action=FlattenSizes,
        nargs="*",
        default=PREFILL_TOKENS,
        help="prefill token counts; none (the flag alone) skips prefill",
    )
    parser.add_argument(
        "--prefill-requests",
        type=sizes_arg,
        action=FlattenSizes,
        nargs="+",
        default=[4],
        metavar="R",
        help="requests each prefill token count is split over, space or comma separated; each count "
        "is timed (default 4; 1: one request; the first count's rows are the prefill table)",
    )
    parser.add_argument("--prompt-len", type=count_arg(1), default=32)
    parser.add_argument("--iters", type=count_arg(1), default=20, help="calls per timed block")
    parser.add_argument("--rounds", type=count_arg(1), default=10, help="measured rounds (one block per method each)")
    parser.add_argument("--warmup-min", type=count_arg(0), default=3, help="fewest warm-up rounds")
    parser.add_argument(
        "--warmup-max", type=count_arg(1), default=40, help="most warm-up rounds (the steady-state cap)"
    )
    parser.add_argument(
        "--warmup-min-s",
        type=float,
        default=4.0,
        help="seconds of warm-up per batch size before the steady test may end it "
        "(a fresh machine's first seconds were a slow plateau)",
    )
    parser.add_argument(
        "--warmup-tol",
        type=float,
        default=0.02,
        help="warm-up ends when each method's median of 3 rounds moves less than this (relative)",
    )
    parser.add_argument("--repeats", type=count_arg(1), default=None, help=argparse.SUPPRESS)  # old name of --rounds
    parser.add_argument(
        "--quick", action="store_true", help="skip the torch.compile baseline and the largest-size-alone captures"
    )
    parser.add_argument(
        "--pin-cpu",
        type=parse_cpus,
        default=None,
        metavar="CPUS",
        help="while timing, run on these CPUs: auto, N, N,M or N-M (default: no pinning)",
    )
    parser.add_argument(
        "--inductor-config",
        choices=["pinned", "default"],
        default="pinned",
        help="pinned (default): inductor picks kernel configs by heuristics, not by timing",
    )
    parser.add_argument(
        "--no-gc-freeze",
        dest="gc_freeze",
        action="store_false",
        help="leave the garbage collector running while timing (default: collect, then freeze)",
    )
    parser.add_argument(
        "--inject-sleep-ms",
        type=parse_sleep,
        action="append",
        metavar="METHOD=MS",
        help="TEST ONLY: sleep MS ms on the host after every call of METHOD (a slowed backend "
        "for compare.py's demonstration); repeatable",
    )
    parser.add_argument(
        "--attention",
        type=attention_arg,
        default=DEFAULT_ATTENTION,
        metavar="NAME",
        help=f"the reference model's attention backend (default {DEFAULT_ATTENTION}; triton: Triton paged "
        "kernels, extra [triton]; flashinfer, flashinfer_tc: FlashInfer's paged wrappers, extra [flashinfer], "
        "bf16; planned_standin: a CPU stand-in of a plan-based attention; a plan-based attention is "
        "re-planned before every hand_graph replay too, and reduce_overhead is not timed with it)",
    )
    parser.add_argument(
        "--isolate",
        dest="isolate",
        action="store_true",
        default=None,
        help="time each compiling method (full+torch_compile, tc_piecewise[:COMPILER], reduce-overhead) in a "
        "fresh process of its own, with eager and the hand-written graph timed in each, and merge the rows "
        "into one JSON (default with --device cuda; benchmarks/isolated.py)",
    )
    parser.add_argument("--no-isolate", dest="isolate", action="store_false", help="every method in this one process")
    parser.add_argument(
        "--isolate-timeout-s",
        type=float,
        default=3600.0,
        metavar="S",
        help="with --isolate: seconds one process may run before it is killed (its rows are then missing)",
    )
    parser.add_argument("--isolated-group", default=None, help=argparse.SUPPRESS)  # set by the isolated parent
    parser.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="also draw ms per step against batch size per method, and prefill ms against "
        "tokens, of the first model into this PNG (the plotter of cuda-graph-runner bench "
        "--plot; needs matplotlib)",
    )
    args = parser.parse_args(argv)
    if args.plot:
        from cuda_graph_runner.cli.plot import PlotUnavailableError, check_plot_available

        try:
            check_plot_available()
        except PlotUnavailableError as exc:
            parser.error(str(exc))
    if args.repeats is not None:
        args.rounds = args.repeats
    if args.iters < 1 or args.rounds < 1 or not 0 <= args.warmup_min <= args.warmup_max or args.warmup_min_s < 0:
        parser.error(
            f"need --iters >= 1, --rounds >= 1, 0 <= --warmup-min <= --warmup-max and --warmup-min-s >= 0; "
            f"got {args.iters}, {args.rounds}, {args.warmup_min}, {args.warmup_max}, {args.warmup_min_s}"
        )
    if args.prefill_tokens and max(args.prefill_requests) > min(args.prefill_tokens):
        parser.error(
            f"--prefill-requests {max(args.prefill_requests)}: more requests than the smallest --prefill-tokens "
            f"({min(args.prefill_tokens)}); accepted: request counts up to {min(args.prefill_tokens)}"
        )
    # Today's spelling of each label (the deprecated full:inductor warns and becomes full+torch_compile).
    args.backends = [label_of(*parse_label(b)) for b in args.backends.split(",") if b.strip()]
    if args.models is None:
        args.models = ["tiny"] if args.device == "cpu" else ["llama-3.2-1b", "qwen2.5-0.5b"]
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "benchmarks/run.py needs a CUDA device (or --device cpu for a smoke test of the harness)", file=sys.stderr
        )
        return 2
    try:  # an optional attention package missing or broken: say so before any work
        make_attention_backend(args.attention)
    except ValueError as exc:
        print(f"benchmarks/run.py: {exc}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    env = {
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "argv": portable_argv(sys.argv[1:] if argv is None else list(argv)),
        "cpus": os.cpu_count(),
        "pinned_cpus": args.pin_cpu,
        "gc_freeze": args.gc_freeze,
        "inductor_cache": inductor_cache_state(),
        "inductor_config": pin_inductor(args.inductor_config),
        "inject_sleep_ms": dict(args.inject_sleep_ms or []),
        "attention": args.attention,
        "gpu_at_start": gpu_state(),
    }
    settings = {
        "iters": args.iters,
        "rounds": args.rounds,
        "warmup_min": args.warmup_min,
        "warmup_max": args.warmup_max,
        "warmup_tol": args.warmup_tol,
        "warmup_min_s": args.warmup_min_s,
        "quick": args.quick,
        "prompt_len": args.prompt_len,
    }
    isolate = args.isolate if args.isolate is not None else args.device == "cuda"
    settings["isolate"] = isolate
    if args.isolated_group:
        settings["isolated_group"] = args.isolated_group
    if isolate:
        return run_isolated(args, sys.argv[1:] if argv is None else list(argv), env, settings)
    if env["inject_sleep_ms"]:
        print(f"TEST ONLY: --inject-sleep-ms {env['inject_sleep_ms']} slows these methods on purpose", flush=True)
    results = Results(args.out, env, settings)
    for name in args.models:
        run_model(name, args, results, args.device)

    unused = set(env["inject_sleep_ms"]) - results.used_sleep
    if unused and not args.isolated_group:  # an isolated parent judges over all its processes
        results.note(f"--inject-sleep-ms named {sorted(unused)}, which no timed method matched")
    return finish(args, results)


def finish(args: argparse.Namespace, results: Results) -> int:
    results.data["env"]["gpu_at_end"] = gpu_state()
    results.save()
    print(render(results.data))
    if args.plot:
        from cuda_graph_runner.cli.plot import plot_results

        print(f"wrote {plot_results(results.document(), args.plot)}")
    return 0


def run_isolated(args: argparse.Namespace, argv: List[str], env: Dict[str, Any], settings: Dict[str, Any]) -> int:
    """``--isolate``: one fresh process of this script per group of methods
    (:func:`isolated.groups`), each writing ``OUT/isolated/GROUP/benchmarks.json``, merged
    (:func:`isolated.merge`) into ``OUT/benchmarks.json``. A process that fails or runs
    past ``--isolate-timeout-s`` is a note, and its rows are missing (compare.py flags them)."""
    timed_ro = args.device == "cuda" and not args.quick and bool(args.reduce_overhead_bs)
    plan = groups(args.backends, reduce_overhead=timed_ro)
    env["isolated_processes"] = plan
    results = Results(args.out, env, settings)
    parts = []
    for group, backends in plan.items():
        out_dir = os.path.join(args.out, "isolated", dir_name(group))
        cmd = [sys.executable, os.path.abspath(__file__), *child_argv(argv, group, backends, out_dir)]
        print(f"== {group}: a fresh process ({', '.join(backends) or 'no backend'}; eager, hand_graph)", flush=True)
        try:
            rc = subprocess.run(cmd, timeout=args.isolate_timeout_s, check=False).returncode
        except subprocess.TimeoutExpired:
            rc = None
            results.note(f"isolated process {group} ran past --isolate-timeout-s={args.isolate_timeout_s:g}")
        path = os.path.join(out_dir, "benchmarks.json")
        if rc not in (0, None):
            results.note(f"isolated process {group} exited with status {rc}")
        try:
            parts.append((group, backends, nested_view(read(path))))
        except (OSError, ResultsSchemaError) as exc:
            results.note(f"isolated process {group}: no results ({type(exc).__name__}: {exc}); its rows are missing")
    models, notes = merge(parts)
    results.data["models"] = models
    results.data["notes"] += notes
    timed = set()
    for group, _, view in parts:
        for label, probes in view.get("host_probe_us", {}).items():
            results.data["host_probe_us"][f"[{group}] {label}"] = probes
    for m in models.values():
        for section in ("decode", "prefill"):
            for row in m.get(section, {}).values():
                timed.update(row)
    unused = set(env["inject_sleep_ms"]) - timed
    if unused:
        results.note(f"--inject-sleep-ms named {sorted(unused)}, which no timed method matched")
    return finish(args, results)


if __name__ == "__main__":
    sys.exit(main())
