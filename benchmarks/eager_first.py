"""Serving from the first request: the ``eager_first`` capture policy against a blocking
capture and pure eager, each start in a fresh process, on one traffic sequence.

Each start builds the preset with a KV cache, then from t = 0 (just before
``runner.capture()``) serves decode steps of a seeded traffic sequence (batch sizes drawn
from ``--live-sizes``; default: those of 1 2 3 5 8 13 24 40 64 up to ``--max-bs``), one
token per request per step:

* ``blocking``: ``capture()`` captures every size, then the steps replay;
* ``eager_first``: ``capture()`` returns at once; after a step the engine loop gives the
  runner ``--budget-ms`` of capture (``runner.capture_step``) while capture has had less
  than ``--capture-share`` of the time so far (the rest serves);
* ``eager``: backend ``disabled``, every step eager.

Every start reaches t = 0 the same way: model and KV cache built, runner built, prompts
prefilled, the device synchronized, then the Python heap collected and frozen
(``gc.collect(); gc.freeze()``, as a server does once its startup is done). Without that
a start enters t = 0 with whatever collection debt its own startup left: a graph
backend's runner imports and allocates more than ``disabled``'s (its plugin, static
buffers, keys), so one full collection of torch's heap (tens of ms) could land inside one
start's first step and not another's, charging startup to the first request. Every start
also gets empty compile caches of its own (``--compile-cache fresh``, the default:
``CUDA_GRAPH_RUNNER_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` in
a temporary folder), so the eager_first start of a compiled backend does not compile
from the entries the blocking start wrote before it (``shared``: the environment's).

A start runs ``--steps`` steps and at least until the blocking start's capture time x
``--until`` (eager_first also until every size replays). Then ``--first-step-repeats``
- 1 more short starts each of eager_first and eager (alternating, fresh processes, one
step each) measure the first step again. Printed: one JSON line per start, then the
summary with the targets:

* ``first_step_ratio``: eager_first's first step (from t = 0) / eager's, the median over
  the repeats of each (target <= 1.1);
* ``full_speed_ratio``: eager_first's time until every size replays / the blocking
  capture (compile included) (target <= 1.5);
* ``tokens_ratio``: tokens eager_first served by the time the blocking start served its
  first / tokens eager served by then (target >= 0.5).

Each start's ``phases`` split its startup (ms: ``model``, ``runner``, ``prefill``, the
``gc`` collection at t = 0; ``frozen_objects``, ``modules``), the graph-only state at t = 0
(``static_buffer_bytes``, whether a graph ``pool`` or a ``capture_stream`` exists yet)
and its first step (ms: ``capture_call``; ``decide``, the runner's work before the
forward; ``forward``, the eager forward's or the replay's host time; ``after``, the
runner's work after it; ``sync``, waiting for the device; ``gc``, collector pauses
inside the step); the summary lists them per mode (``first_step_phases``).

``--json PATH`` writes every start's timeline (per step: end time ms, step ms, capture ms,
sizes ready) and the summary; ``--plot PATH`` draws ms per step over the first steps and
the sizes becoming ready (matplotlib, optional). ``--time-limit-s`` (default 600) bounds
the whole run (every start's process included): a start still running at the limit is
killed with its process group and the run fails naming it.

    python benchmarks/eager_first.py --device cuda --dtype bfloat16 --model llama-3.2-1b \\
        --backend full --json eager_first_full.json --plot docs/eager-first-full.png
    # compiled full, bounded: 36 sizes, each start compiling cold (about 33 s on an H200:
    # benchmarks/results/2026-12-03-h200-eager-first)
    python benchmarks/eager_first.py --device cuda --dtype bfloat16 --model llama-3.2-1b \\
        --backend full+torch_compile --until 1.2 --time-limit-s 240 --json eager_first_compiled.json
    # the same with 12 sizes (up to 64, every live size) if the limit stops the one above
    python benchmarks/eager_first.py --device cuda --dtype bfloat16 --model llama-3.2-1b \\
        --backend full+torch_compile --max-bs 64 --until 1.2 --time-limit-s 240 --json eager_first_compiled.json
    python benchmarks/eager_first.py --backend full --model tiny --max-bs 16 --steps 50   # CPU, fake graphs

Exit status 0 when every start ran (the ratios are measurements, not a test); 2 for a
user's mistake (named in one line); 1 when a start failed or the time limit stopped it
(its output shown).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

MODES = ("blocking", "eager_first", "eager")
#: ``--live-sizes``'s default: the sizes of these up to ``--max-bs`` (sizes given
#: explicitly must all lie in 1..--max-bs).
DEFAULT_LIVE_SIZES = (1, 2, 3, 5, 8, 13, 24, 40, 64)
#: ``--dtype``'s accepted values (torch dtypes of the reference model).
DTYPES = ("float32", "bfloat16", "float16")


def traffic(live_sizes: List[int], steps: int, seed: int) -> List[int]:
    """The batch size of each step: a seeded draw from ``live_sizes``, smaller sizes more
    often (weight 1/rank), as a server's queue is mostly short."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(len(live_sizes))]
    return rng.choices(sorted(live_sizes), weights=weights, k=steps)


def _backend(args: argparse.Namespace, name: str, compiler: Optional[str]) -> Any:
    import torch

    if name == "full" and torch.device(args.device).type == "cpu":
        # full's own code path on the CPU: the recording fake graph module stands in
        # for CUDA graphs (what is measured is the policy, not the device).
        from cuda_graph_runner.cli.bench.backends import TORCH_COMPILE
        from cuda_graph_runner.testing.fakes import FakeGraphDeviceModule
        from cuda_graph_runner_full.backend import FullCudaGraphBackend

        return FullCudaGraphBackend(
            "cpu",
            phase="decode",
            device_module=FakeGraphDeviceModule(),
            memory_pool="pool",
            compiler="inductor" if compiler == TORCH_COMPILE else compiler,
        )
    return None


class FirstStepProbe:
    """Times the phases of one ``runner.forward`` call from outside the runner: the
    instance's ``run_eager`` (eager path) and ``replay`` (replay path) are wrapped for the
    call only, and the collector's pauses inside it are summed (``gc.callbacks``)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.entered: Optional[float] = None
        self.left: Optional[float] = None
        self.gc_s = 0.0
        self._gc_start: Optional[float] = None

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            self.entered = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.left = time.perf_counter()

        return timed

    def _gc(self, phase: str, info: Dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            self.gc_s += time.perf_counter() - self._gc_start
            self._gc_start = None

    def __enter__(self) -> "FirstStepProbe":
        # Instance attributes shadow the methods for this call; __exit__ removes them.
        self.runner.run_eager = self._wrap(self.runner.run_eager)
        self.runner.replay = self._wrap(self.runner.replay)
        gc.callbacks.append(self._gc)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._gc)
        del self.runner.run_eager, self.runner.replay

    def phases(self, start: float, forward_end: float, end: float) -> Dict[str, float]:
        """ms of the step begun at ``start``: ``decide`` (the runner's work before the
        eager forward or the replay), ``forward``, ``after`` (its work after), ``sync``
        (waiting for the device), ``gc`` (collector pauses anywhere in the step)."""
        entered = self.entered if self.entered is not None else forward_end
        left = self.left if self.left is not None else forward_end
        return {
            "decide": 1e3 * (entered - start),
            "forward": 1e3 * (left - entered),
            "after": 1e3 * (forward_end - left),
            "sync": 1e3 * (end - forward_end),
            "gc": 1e3 * self.gc_s,
        }


def graph_state(runner: Any) -> Dict[str, Any]:
    """The graph-only state a runner holds now: its static buffers' bytes, and whether the
    process has a graph memory pool or a capture stream yet."""
    from cuda_graph_runner.backend import pool

    return {
        "static_buffer_bytes": runner.buffers.nbytes(),
        "pool": bool(pool._pools),
        "capture_stream": bool(pool._streams),
        "graphs": len(runner.captured_keys),
    }


def settle_heap() -> Dict[str, Any]:
    """Collect and freeze the Python heap (every start does this just before t = 0); the
    collection's ms, the objects frozen and the modules loaded."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    return {
        "gc": 1e3 * (time.perf_counter() - start),
        "frozen_objects": gc.get_freeze_count(),
        "modules": len(sys.modules),
    }


def _start(args: argparse.Namespace) -> Dict[str, Any]:
    """One start of ``args.one`` (a mode); its timeline as a JSON-able dict."""
    import torch

    from cuda_graph_runner.cli.bench.backends import label_options, parse_label
    from cuda_graph_runner.reference.batches import GreedySession, make_decode_batch, make_dummy_prompts
    from cuda_graph_runner.runner import DecodeCudaGraphRunner
    from cuda_graph_runner.testing.reference_setup import reference_model

    mode = args.one
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    live = sorted(set(args.live_sizes))
    context = args.prompt_len + len(live) + 2
    setup: Dict[str, Any] = {}
    mark = time.perf_counter()
    model = reference_model(args.model, requests=max(live), context=context, dtype=dtype, device=args.device)
    sync()
    setup["model"], mark = 1e3 * (time.perf_counter() - mark), time.perf_counter()
    name, compiler = parse_label(args.backend)
    decode: Dict[str, Any] = {"backend": "disabled" if mode == "eager" else name, "max_bs": args.max_bs}
    if mode != "eager":
        decode.update(label_options(compiler, args.max_bs, None))
        decode["capture"] = "eager_first" if mode == "eager_first" else "blocking"
    backend = _backend(args, name, compiler) if mode != "eager" else None
    runner = DecodeCudaGraphRunner(model, {"decode": decode}, device=args.device, backend=backend, show_progress=False)
    sync()
    setup["runner"], mark = 1e3 * (time.perf_counter() - mark), time.perf_counter()
    with torch.no_grad():
        session = GreedySession(model, model.kv_cache)
        prompts = make_dummy_prompts(max(live), [args.prompt_len] * max(live), model.config.vocab_size, seed=1)
        session.prefill(prompts)
        batches = {
            bs: make_decode_batch(model.kv_cache, session.rows[:bs], None, [t[-1] for t in session.tokens[:bs]])
            for bs in live
        }
    sync()
    setup["prefill"] = 1e3 * (time.perf_counter() - mark)
    sizes = traffic(live, args.steps_cap, args.seed)
    setup.update(settle_heap())
    at_t0 = graph_state(runner)
    timeline: List[Dict[str, Any]] = []
    first_step: Dict[str, float] = {}
    t0 = time.perf_counter()
    runner.capture()
    capture_call_ms = 1e3 * (time.perf_counter() - t0)
    lazy = runner.lazy_capture
    total = len(runner.capture_sizes)
    full_speed_ms: Optional[float] = None if mode == "eager_first" else capture_call_ms
    first_replay_ms: Optional[float] = None
    until_s = args.until_s
    capture_s = 0.0
    for i, bs in enumerate(sizes):
        start = time.perf_counter()
        replays = sum(runner.stats.replays_by_size.values())
        if i == 0:
            with FirstStepProbe(runner) as probe:
                runner.forward(batches[bs])
                forward_end = time.perf_counter()
                sync()
                end = time.perf_counter()
            first_step = {"capture_call": capture_call_ms, **probe.phases(start, forward_end, end)}
            first_step["total"] = 1e3 * (end - t0)
        else:
            runner.forward(batches[bs])
            sync()
            end = time.perf_counter()
        if first_replay_ms is None and sum(runner.stats.replays_by_size.values()) > replays:
            first_replay_ms = 1e3 * (end - t0)
        capture_ms = 0.0
        # The engine's schedule: capture only while capture has had less than its share
        # of the time so far, so serving keeps the rest.
        if (
            lazy is not None
            and not args.first_step_only
            and full_speed_ms is None
            and capture_s <= args.capture_share * (end - t0)
        ):
            step = runner.capture_step(args.budget_ms)
            sync()
            capture_ms = 1e3 * (time.perf_counter() - end)
            capture_s += capture_ms / 1e3
            if step.done:
                full_speed_ms = 1e3 * (time.perf_counter() - t0)
        ready = lazy.ready() if lazy is not None else (0 if mode == "eager" else total)
        timeline.append(
            {
                "step": i,
                "bs": bs,
                "end_ms": 1e3 * (end - t0),  # its tokens are served here; the capture step follows
                "step_ms": 1e3 * (end - start),
                "capture_ms": capture_ms,
                "ready": ready,
            }
        )
        if args.first_step_only:
            break
        elapsed = time.perf_counter() - t0
        if i + 1 >= args.steps and elapsed >= until_s and (mode != "eager_first" or full_speed_ms is not None):
            break
    stats = runner.run_stats()
    session.close()
    return {
        "mode": mode,
        "backend": "disabled" if mode == "eager" else args.backend,  # the backend this start ran
        "capture_call_ms": capture_call_ms,
        "first_step_ms": timeline[0]["end_ms"],
        "first_replay_ms": first_replay_ms,
        "full_speed_ms": full_speed_ms,
        "sizes": total,
        "pool_mib": stats["pool_mib"],
        "replays": stats["replays"],
        "eager": stats["eager_total"],
        "phases": {"setup_ms": setup, "at_t0": at_t0, "first_step_ms": first_step},
        "timeline": timeline,
    }


def tokens_by(timeline: List[Dict[str, Any]], ms: float) -> int:
    """Tokens (one per request per step) of the steps that ended by ``ms``."""
    return sum(row["bs"] for row in timeline if row["end_ms"] <= ms)


def summary(
    starts: Dict[str, Dict[str, Any]], repeats: Optional[Dict[str, List[Dict[str, Any]]]] = None
) -> Dict[str, Any]:
    """The targets' ratios from the three starts; ``repeats``: the short starts of
    ``eager_first`` and ``eager`` that measured the first step again (each mode's first
    step is the median over its full start and its repeats)."""
    blocking, lazy, eager = starts["blocking"], starts["eager_first"], starts["eager"]
    repeats = repeats or {}
    first_steps = {
        mode: [starts[mode]["first_step_ms"]] + [r["first_step_ms"] for r in repeats.get(mode, [])]
        for mode in ("eager_first", "eager")
    }
    lazy_first = statistics.median(first_steps["eager_first"])
    eager_first_step = statistics.median(first_steps["eager"])
    first_blocking_ms = blocking["first_step_ms"]  # the blocking start's first token
    eager_tokens = tokens_by(eager["timeline"], first_blocking_ms)
    lazy_tokens = tokens_by(lazy["timeline"], first_blocking_ms)
    phases = {
        mode: [s["phases"]["first_step_ms"] for s in [starts[mode], *repeats.get(mode, [])] if "phases" in s]
        for mode in MODES
    }
    return {
        "blocking_capture_ms": blocking["capture_call_ms"],
        "eager_first_step_ms": eager_first_step,
        "eager_first_first_step_ms": lazy_first,
        "first_steps_ms": first_steps,
        "first_step_ratio": lazy_first / eager_first_step,
        "first_step_phases": phases,
        "first_replay_ms": lazy["first_replay_ms"],
        "full_speed_ms": lazy["full_speed_ms"],
        "full_speed_ratio": (lazy["full_speed_ms"] or float("inf")) / blocking["capture_call_ms"],
        "tokens_by_blocking_first": {"eager_first": lazy_tokens, "eager": eager_tokens},
        "tokens_ratio": lazy_tokens / eager_tokens if eager_tokens else None,
        "pool_mib": {"blocking": blocking["pool_mib"], "eager_first": lazy["pool_mib"]},
        "targets": {"first_step_ratio": "<= 1.1", "full_speed_ratio": "<= 1.5", "tokens_ratio": ">= 0.5"},
    }


def targets_line(result: Dict[str, Any]) -> str:
    """The three ratios against their targets, one line: ``name value (target, met|missed)``."""
    parts = []
    for name, target in result["targets"].items():
        value = result[name]
        op, bound = target.split()
        met = value is not None and (value <= float(bound) if op == "<=" else value >= float(bound))
        shown = "n/a" if value is None else f"{value:.2f}"
        parts.append(f"{name} {shown} ({target}, {'met' if met else 'missed'})")
    return "targets: " + "; ".join(parts)


def plot(starts: Dict[str, Dict[str, Any]], path: str, steps: int, title: str) -> str:
    """Two panels: ms per step (forward + capture step) over the first ``steps`` steps
    against time, and capture sizes ready against time."""
    from cuda_graph_runner.cli.plot import check_plot_available

    check_plot_available()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8.0, 6.4), sharex=True)
    styles = {"blocking": {"color": "tab:blue"}, "eager_first": {"color": "tab:orange"}, "eager": {"color": "black"}}
    for mode, start in starts.items():
        rows = start["timeline"][:steps]
        xs = [r["end_ms"] / 1e3 for r in rows]
        top.plot(xs, [r["step_ms"] + r["capture_ms"] for r in rows], ".", markersize=3, label=mode, **styles[mode])
        if mode != "eager":
            bottom.step([0.0] + xs, [0] + [r["ready"] for r in rows], where="post", label=mode, **styles[mode])
    top.set_yscale("log")
    top.set_ylabel("ms per step (forward + capture step)")
    top.set_title(title)
    top.grid(True, alpha=0.3)
    top.legend()
    bottom.set_xlabel("seconds since capture() was called")
    bottom.set_ylabel("capture sizes replaying")
    bottom.grid(True, alpha=0.3)
    bottom.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _child_args(args: argparse.Namespace) -> List[str]:
    """The command line of one start: this script with the run's options."""
    out = [sys.executable, os.path.abspath(__file__)]
    flags = (
        "model",
        "backend",
        "device",
        "dtype",
        "max_bs",
        "prompt_len",
        "steps",
        "budget_ms",
        "capture_share",
        "seed",
    )
    for flag in flags:
        out += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    return out + ["--live-sizes"] + [str(s) for s in args.live_sizes]


#: The environment variables of the compile caches a fresh start gets empty folders for.
CACHE_VARS = {"CUDA_GRAPH_RUNNER_CACHE_DIR": "cgr", "TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


class TimeLimitError(RuntimeError):
    """The run's ``--time-limit-s`` stopped a start."""


#: ``--time-limit-s``'s default (seconds): a hung start fails the run instead of hanging it.
DEFAULT_TIME_LIMIT_S = 600.0


def _text(out: Any) -> str:
    """A captured stream as text (a timeout's partial output may come back as bytes)."""
    if out is None:
        return ""
    return out.decode("utf-8", "replace") if isinstance(out, bytes) else str(out)


def start_env(compile_cache: str, folder: str) -> Dict[str, str]:
    """The environment of one start: ``fresh``: empty compile cache folders under
    ``folder`` (:data:`CACHE_VARS`); ``shared``: this process's environment as it is."""
    env = dict(os.environ)
    if compile_cache == "fresh":
        for var, sub in CACHE_VARS.items():
            env[var] = os.path.join(folder, sub)
    return env


def _run_one(
    me: List[str],
    mode: str,
    until_s: float,
    *,
    compile_cache: str = "fresh",
    deadline: Optional[float] = None,
    extra: Optional[List[str]] = None,
) -> Dict[str, Any]:
    """Run one start in a fresh process (its own compile caches unless ``shared``); its
    JSON. Raises RuntimeError when it fails, :class:`TimeLimitError` when ``deadline``
    (a ``time.monotonic()`` value) passes first."""
    timeout = None if deadline is None else max(deadline - time.monotonic(), 1.0)
    with tempfile.TemporaryDirectory(prefix=f"eager-first-{mode}-") as folder:
        # A session of its own: at the limit its whole process group goes (compile workers too).
        proc = subprocess.Popen(
            me + ["--one", mode, "--until-s", str(until_s)] + (extra or []),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=start_env(compile_cache, folder),
            start_new_session=True,
        )
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:  # what it wrote before the kill (a grandchild holding the pipes is killed too)
                stdout, stderr = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = exc.stdout, exc.stderr
            raise TimeLimitError(
                f"the {mode} start was stopped by --time-limit-s after {timeout:.0f} s: fewer sizes "
                f"(--max-bs), a smaller --until or a larger limit\n{_text(stdout)}\n{_text(stderr)}"
            ) from exc
        except BaseException:  # interrupted: no start outlives the run
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            raise
    if proc.returncode != 0:
        raise RuntimeError(f"the {mode} start failed (exit {proc.returncode}):\n{stdout}\n{stderr}")
    return json.loads(stdout.strip().splitlines()[-1])


def backend_labels() -> List[str]:
    """The ``--backend`` labels accepted: each installed backend's name, with
    ``:tc_compiler`` for a backend that reads ``tc_compiler`` and ``+torch_compile`` for
    one that reads ``torch_compile``."""
    from cuda_graph_runner.backend.options import declared_reads
    from cuda_graph_runner.cli.bench.backends import TORCH_COMPILE, label_of
    from cuda_graph_runner.config import TC_COMPILERS
    from cuda_graph_runner.registry import get_registry

    reg = get_registry()
    labels = []
    for name in reg.names():
        reads = declared_reads(reg, name) or ()
        labels.append(name)
        if "torch_compile" in reads:
            labels.append(label_of(name, TORCH_COMPILE))
        if "tc_compiler" in reads:
            labels += [label_of(name, compiler) for compiler in TC_COMPILERS]
    return labels


def device_problem(spec: str) -> Optional[str]:
    """What is wrong with ``--device`` (the value and what is accepted, one line), or None:
    a torch device string of type cpu or cuda, a cuda one only where CUDA is available (and
    its index below the device count)."""
    import torch

    try:
        device = torch.device(spec)
    except RuntimeError:  # torch's own message lists every device type it knows, not ours
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        return f"--device {spec!r}: accepted cpu, cuda, cuda:N"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"--device {spec!r}: no CUDA device here; accepted cpu"
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            shown = ", ".join(["cpu", "cuda", *(f"cuda:{i}" for i in range(count))])
            return f"--device {spec!r}: {count} CUDA device(s) here; accepted {shown}"
    return None


def choice_problem(args: argparse.Namespace) -> Optional[str]:
    """What is wrong with ``--dtype``, ``--device``, ``--model`` or ``--backend`` (the bad
    value and what is accepted, one line), or None."""
    if args.dtype not in DTYPES:
        return f"--dtype {args.dtype!r}: accepted {', '.join(DTYPES)}"
    problem = device_problem(args.device)
    if problem:
        return problem
    from cuda_graph_runner.cli.bench.backends import label_of, parse_label
    from cuda_graph_runner.reference.model import PRESETS

    if args.model not in PRESETS:
        return f"--model {args.model!r}: accepted {', '.join(sorted(PRESETS))}"
    labels = backend_labels()
    if label_of(*parse_label(args.backend)) not in labels:  # a deprecated spelling reads as its new one
        return f"--backend {args.backend!r}: accepted {', '.join(labels)}"
    return None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny", help="a reference preset (default tiny)")
    p.add_argument(
        "--backend",
        default="full",
        help="a bench label: an installed backend, name:tc_compiler or name+torch_compile\n"
        "(full, full+torch_compile, breakable, tc_piecewise:inductor, ...; default full)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help=f"the model's dtype: {', '.join(DTYPES)} (default float32)")
    p.add_argument("--max-bs", type=int, default=256, help="largest capture size (default 256: 36 decode sizes)")
    p.add_argument(
        "--live-sizes",
        type=int,
        nargs="+",
        default=None,
        help="the traffic's batch sizes, each in 1..--max-bs (default: those of\n"
        f"{' '.join(map(str, DEFAULT_LIVE_SIZES))} up to --max-bs)",
    )
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=300, help="steps at least (the timeline's length)")
    p.add_argument("--budget-ms", type=float, default=20.0, help="budget of one capture_step call (eager_first)")
    p.add_argument(
        "--capture-share",
        type=float,
        default=0.6,
        help="eager_first: call capture_step after a step only while capture has had less than\n"
        "this share of the time so far (default 0.6; 1: after every step)",
    )
    p.add_argument(
        "--until",
        type=float,
        default=1.6,
        help="run each start until this x the blocking start's first token (>= 1; default 1.6)",
    )
    p.add_argument(
        "--first-step-repeats",
        type=int,
        default=3,
        help="first steps measured per mode (eager_first, eager): the full start and this\n"
        "- 1 short starts of one step each, alternating (default 3; the ratio takes medians)",
    )
    p.add_argument(
        "--compile-cache",
        choices=("fresh", "shared"),
        default="fresh",
        help="fresh (default): every start empty compile caches of its own;\n"
        "shared: the environment's (later starts may compile from earlier starts' entries)",
    )
    p.add_argument(
        "--time-limit-s",
        type=float,
        default=DEFAULT_TIME_LIMIT_S,
        help=f"bound the whole run (every start's process; default {DEFAULT_TIME_LIMIT_S:.0f} s): a start\n"
        "past it is killed with its process group and fails the run",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the starts and the summary here")
    p.add_argument("--plot", help="draw the timeline into this PNG (needs matplotlib)")
    p.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--until-s", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--first-step-only", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.max_bs < 1:
        print(f"error: --max-bs {args.max_bs}: must be >= 1", file=sys.stderr)
        return 2
    if args.live_sizes is None:
        args.live_sizes = [s for s in DEFAULT_LIVE_SIZES if s <= args.max_bs]
    if args.max_bs < max(args.live_sizes) or min(args.live_sizes) < 1:
        print(f"error: --live-sizes {args.live_sizes} must lie in 1..--max-bs {args.max_bs}", file=sys.stderr)
        return 2
    if args.budget_ms <= 0:
        print(f"error: --budget-ms {args.budget_ms}: must be > 0", file=sys.stderr)
        return 2
    if not 0 < args.capture_share <= 1:
        print(f"error: --capture-share {args.capture_share}: must be in (0, 1]", file=sys.stderr)
        return 2
    if not args.until >= 1:  # tokens_ratio counts eager's tokens up to the blocking start's first
        print(f"error: --until {args.until}: must be >= 1", file=sys.stderr)
        return 2
    if args.first_step_repeats < 1:
        print(f"error: --first-step-repeats {args.first_step_repeats}: must be >= 1", file=sys.stderr)
        return 2
    if not (math.isfinite(args.time_limit_s) and args.time_limit_s > 0):
        print(f"error: --time-limit-s {args.time_limit_s}: must be a finite number of seconds > 0", file=sys.stderr)
        return 2
    # The parent checks the choices before any start (a start gets them checked, and its
    # startup phases stay free of the registry scan the check makes).
    problem = None if args.one else choice_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    # Enough sizes drawn for any run length; a start stops by its own rule.
    args.steps_cap = max(args.steps, 1) * 1000
    if args.one:
        print(json.dumps(_start(args)))
        return 0
    if args.plot:
        from cuda_graph_runner.cli.plot import PlotUnavailableError, check_plot_available

        try:
            check_plot_available()
        except PlotUnavailableError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    me = _child_args(args)
    deadline = time.monotonic() + args.time_limit_s
    repeats: Dict[str, List[Dict[str, Any]]] = {"eager_first": [], "eager": []}
    try:
        run = {"compile_cache": args.compile_cache, "deadline": deadline}
        starts = {"blocking": _run_one(me, "blocking", 0.0, **run)}
        until_s = args.until * starts["blocking"]["first_step_ms"] / 1e3
        starts["eager_first"] = _run_one(me, "eager_first", until_s, **run)
        starts["eager"] = _run_one(me, "eager", until_s, **run)
        for i in range(args.first_step_repeats - 1):
            # Alternating, so a drift of the machine over the run favours neither mode.
            for mode in ("eager", "eager_first") if i % 2 == 0 else ("eager_first", "eager"):
                repeats[mode].append(_run_one(me, mode, 0.0, extra=["--first-step-only"], **run))
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    for start in starts.values():
        print(json.dumps({k: v for k, v in start.items() if k != "timeline"}))
    result = summary(starts, repeats)
    print(json.dumps(result, indent=2))
    print(targets_line(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": {k: v for k, v in vars(args).items() if k not in ("one", "first_step_only")},
                    "starts": starts,
                    "repeats": repeats,
                    "summary": result,
                },
                f,
            )
    if args.plot:
        print("plot:", plot(starts, args.plot, args.steps, f"{args.model} decode, {args.backend}: capture policies"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
