"""Serving from the first request: the ``eager_first`` capture policy against a blocking
capture and pure eager, each start in a fresh process, on one traffic sequence.

Each start builds the preset with a KV cache, then from t = 0 (just before
``runner.capture()``) serves decode steps of a seeded traffic sequence (batch sizes drawn
from ``--live-sizes``), one token per request per step:

* ``blocking``: ``capture()`` captures every size, then the steps replay;
* ``eager_first``: ``capture()`` returns at once; after a step the engine loop gives the
  runner ``--budget-ms`` of capture (``runner.capture_step``) while capture has had less
  than ``--capture-share`` of the time so far (the rest serves);
* ``eager``: backend ``disabled``, every step eager.

A start runs ``--steps`` steps and at least until the blocking start's capture time x
``--until`` (eager_first also until every size replays). Printed: one JSON line per start,
then the summary with the issue's targets:

* ``first_step_ratio``: eager_first's first step (from t = 0) / eager's (target <= 1.1);
* ``full_speed_ratio``: eager_first's time until every size replays / the blocking
  capture (compile included) (target <= 1.5);
* ``tokens_ratio``: tokens eager_first served by the time the blocking start served its
  first / tokens eager served by then (target >= 0.5).

``--json PATH`` writes every start's timeline (per step: end time ms, step ms, capture ms,
sizes ready) and the summary; ``--plot PATH`` draws ms per step over the first steps and
the sizes becoming ready (matplotlib, optional).

    python benchmarks/eager_first.py --device cuda --dtype bfloat16 --model llama-3.2-1b \\
        --backend full --json eager_first_full.json --plot docs/eager-first-full.png
    python benchmarks/eager_first.py --device cuda --dtype bfloat16 --model llama-3.2-1b \\
        --backend full+torch_compile --json eager_first_compiled.json --plot docs/eager-first-compiled.png
    python benchmarks/eager_first.py --backend full --model tiny --max-bs 16 --steps 50   # CPU, fake graphs

Exit status 0 when every start ran (the ratios are measurements, not a test); 2 for a
user's mistake (named in one line); 1 when a start failed (its output shown).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

MODES = ("blocking", "eager_first", "eager")


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


def _start(args: argparse.Namespace) -> Dict[str, Any]:
    """One start of ``args.one`` (a mode); its timeline as a JSON-able dict."""
    import torch

    from cuda_graph_runner.cli.bench.backends import label_options, parse_label
    from cuda_graph_runner.reference.batches import GreedySession, make_decode_batch, make_dummy_prompts
    from cuda_graph_runner.runner import DecodeCudaGraphRunner
    from cuda_graph_runner.testing.reference_setup import reference_model

    mode = args.one
    dtype = getattr(torch, args.dtype)
    live = sorted(set(args.live_sizes))
    context = args.prompt_len + len(live) + 2
    model = reference_model(args.model, requests=max(live), context=context, dtype=dtype, device=args.device)
    name, compiler = parse_label(args.backend)
    decode: Dict[str, Any] = {"backend": "disabled" if mode == "eager" else name, "max_bs": args.max_bs}
    if mode != "eager":
        decode.update(label_options(compiler, args.max_bs, None))
        decode["capture"] = "eager_first" if mode == "eager_first" else "blocking"
    backend = _backend(args, name, compiler) if mode != "eager" else None
    runner = DecodeCudaGraphRunner(model, {"decode": decode}, device=args.device, backend=backend, show_progress=False)
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        session = GreedySession(model, model.kv_cache)
        prompts = make_dummy_prompts(max(live), [args.prompt_len] * max(live), model.config.vocab_size, seed=1)
        session.prefill(prompts)
        batches = {
            bs: make_decode_batch(model.kv_cache, session.rows[:bs], None, [t[-1] for t in session.tokens[:bs]])
            for bs in live
        }
    sync()
    sizes = traffic(live, args.steps_cap, args.seed)
    timeline: List[Dict[str, Any]] = []
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
        runner.forward(batches[bs])
        sync()
        end = time.perf_counter()
        if first_replay_ms is None and sum(runner.stats.replays_by_size.values()) > replays:
            first_replay_ms = 1e3 * (end - t0)
        capture_ms = 0.0
        # The engine's schedule: capture only while capture has had less than its share
        # of the time so far, so serving keeps the rest.
        if lazy is not None and full_speed_ms is None and capture_s <= args.capture_share * (end - t0):
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
        elapsed = time.perf_counter() - t0
        if i + 1 >= args.steps and elapsed >= until_s and (mode != "eager_first" or full_speed_ms is not None):
            break
    stats = runner.run_stats()
    session.close()
    return {
        "mode": mode,
        "backend": args.backend,
        "capture_call_ms": capture_call_ms,
        "first_step_ms": timeline[0]["end_ms"],
        "first_replay_ms": first_replay_ms,
        "full_speed_ms": full_speed_ms,
        "sizes": total,
        "pool_mib": stats["pool_mib"],
        "replays": stats["replays"],
        "eager": stats["eager_total"],
        "timeline": timeline,
    }


def tokens_by(timeline: List[Dict[str, Any]], ms: float) -> int:
    """Tokens (one per request per step) of the steps that ended by ``ms``."""
    return sum(row["bs"] for row in timeline if row["end_ms"] <= ms)


def summary(starts: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """The targets' ratios from the three starts."""
    blocking, lazy, eager = starts["blocking"], starts["eager_first"], starts["eager"]
    first_blocking_ms = blocking["first_step_ms"]  # the blocking start's first token
    eager_tokens = tokens_by(eager["timeline"], first_blocking_ms)
    lazy_tokens = tokens_by(lazy["timeline"], first_blocking_ms)
    return {
        "blocking_capture_ms": blocking["capture_call_ms"],
        "eager_first_step_ms": eager["first_step_ms"],
        "eager_first_first_step_ms": lazy["first_step_ms"],
        "first_step_ratio": lazy["first_step_ms"] / eager["first_step_ms"],
        "first_replay_ms": lazy["first_replay_ms"],
        "full_speed_ms": lazy["full_speed_ms"],
        "full_speed_ratio": (lazy["full_speed_ms"] or float("inf")) / blocking["capture_call_ms"],
        "tokens_by_blocking_first": {"eager_first": lazy_tokens, "eager": eager_tokens},
        "tokens_ratio": lazy_tokens / eager_tokens if eager_tokens else None,
        "pool_mib": {"blocking": blocking["pool_mib"], "eager_first": lazy["pool_mib"]},
        "targets": {"first_step_ratio": "<= 1.1", "full_speed_ratio": "<= 1.5", "tokens_ratio": ">= 0.5"},
    }


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


def _run_one(me: List[str], mode: str, until_s: float) -> Dict[str, Any]:
    proc = subprocess.run(me + ["--one", mode, "--until-s", str(until_s)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the {mode} start failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny", help="a reference preset (default tiny)")
    p.add_argument("--backend", default="full", help="a bench label: full, full+torch_compile, breakable, ...")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-bs", type=int, default=256, help="largest capture size (default 256: 36 decode sizes)")
    p.add_argument("--live-sizes", type=int, nargs="+", default=[1, 2, 3, 5, 8, 13, 24, 40, 64])
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
    p.add_argument("--until", type=float, default=1.6, help="run each start until this x the blocking capture")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the starts and the summary here")
    p.add_argument("--plot", help="draw the timeline into this PNG (needs matplotlib)")
    p.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--until-s", type=float, default=0.0, help=argparse.SUPPRESS)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.max_bs < max(args.live_sizes) or min(args.live_sizes) < 1:
        print(f"error: --live-sizes {args.live_sizes} must lie in 1..--max-bs {args.max_bs}", file=sys.stderr)
        return 2
    if args.budget_ms <= 0:
        print(f"error: --budget-ms {args.budget_ms}: must be > 0", file=sys.stderr)
        return 2
    if not 0 < args.capture_share <= 1:
        print(f"error: --capture-share {args.capture_share}: must be in (0, 1]", file=sys.stderr)
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
    try:
        starts = {"blocking": _run_one(me, "blocking", 0.0)}
        until_s = args.until * starts["blocking"]["capture_call_ms"] / 1e3
        starts["eager_first"] = _run_one(me, "eager_first", until_s)
        starts["eager"] = _run_one(me, "eager", until_s)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    for start in starts.values():
        print(json.dumps({k: v for k, v in start.items() if k != "timeline"}))
    result = summary(starts)
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"args": {k: v for k, v in vars(args).items() if k != "one"}, "starts": starts, "summary": result}, f
            )
    if args.plot:
        print("plot:", plot(starts, args.plot, args.steps, f"{args.model} decode, {args.backend}: capture policies"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
