#!/usr/bin/env python3
"""Host cost of the data-parallel step agreement, blocking and overlapped, and its share
of a decode step (CPU, gloo; one bounded run).

Spawns ``--dp`` ranks on this host (:func:`cuda_graph_runner.testing.tp_launch.run_ranks`:
bounded in time, gloo). Rank 0 holds ``--bs`` decode requests, the others ``--bs // 2``
(ragged: the step pads them up). On each rank, in one run:

* ``floor µs``: one bare gloo all-reduce of one int64 on the group (what any per-step
  host agreement costs at least: the agreement's own collective with one graph
  variant), and ``floor5 µs``: of five int64s (its collective with several variants);
* ``agree µs``: one blocking :meth:`cuda_graph_runner.runner.dp_group.DPGroup.agree_batch`
  (one int64: the reference model has one graph variant; no device sync), and ``host µs``: the same with
  ``torch.distributed.all_reduce`` replaced by a no-op (its own host work);
* decode steps of the reference model's DP layout through the runner (the ``full``
  backend on emulated CPU graphs: the model's work, its collectives included), in two
  arms interleaved step by step. Each step first does the engine's work of building the
  step's batch: :func:`cuda_graph_runner.reference.batches.make_decode_batch` (one KV
  slot allocated per request, the input tensors made from the host's lists; ``build
  µs``), then ``runner.forward(batch)``:

  - ``blocking``: ``forward`` runs the agreement itself after the batch is built; its
    cost is the time in ``agree_batch`` inside ``forward`` (``block µs``);
  - ``overlapped``: ``runner.start_step_agreement(live size)`` before the build,
    ``forward`` waits on it. Its cost is the start call (``start µs``: this rank's
    checks and the issue, ``issue µs`` of it in ``DPGroup.start_agree_batch``) plus the
    time ``forward`` blocks in the handle's wait (``wait µs``); ``overlap µs`` is the
    median of their per-step sum. ``preempt``: the share of issues during which this thread was preempted (an
    involuntary context switch, Linux): on a host without an idle core the issue hands
    the core to the gloo worker thread it wakes, and costs a scheduler slice;

  ``step ms``: one blocking ``forward`` (the emulated step);
* ``share``: each agreement cost over a decode step: the emulated step measured here,
  and ``--step-ms`` (default: the reference llama-3.2-1b decode step at batch 1 with the
  ``full`` backend on an H200, 2.140 ms: ``benchmarks/results/2026-12-01-h200-decode``).

The call counts are agreed by the ranks from a short calibration so that each part fits
its share of ``--budget-s`` (every rank runs the same counts: the calls are collectives);
the run prints its phases' seconds (``start``: spawning the ranks, their imports and
process group). Medians over the calls (``host``: over blocks of 200).
Usage::

    python benchmarks/dp_agreement.py                  # DP=2, preset tiny, bs 8
    python benchmarks/dp_agreement.py --json $OUT/dp_agreement.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch

try:
    import resource
except ImportError:  # not on every platform: the preemption count is then 0
    resource = None  # type: ignore[assignment]

#: The per-step agreement's target host cost (µs), the bare collective's included.
TARGET_US = 100
#: The share of a decode step the agreement may take.
TARGET_SHARE = 0.05
#: The reference decode step the share is stated against (ms): llama-3.2-1b, batch 1,
#: ``full``, H200 (benchmarks/results/2026-12-01-h200-decode/benchmarks-log.txt).
REFERENCE_STEP_MS = 2.140
REFERENCE_STEP = "llama-3.2-1b decode, batch 1, full, H200 (benchmarks/results/2026-12-01-h200-decode)"

#: ``--help``'s epilog: what each printed column is.
COLUMNS_HELP = """\
Every µs and ms is a median over the timed calls (their counts fit --budget-s; the same
on every rank).

columns of the first table (one row per rank):
  rank            the rank
  live bs         the rank's decode requests (rank 0: --bs; the others: --bs // 2)
  floor µs        one bare gloo all-reduce (MIN) of one int64 on the group
  floor5 µs       the same of five int64s
  agree µs        one blocking DPGroup.agree_batch (one int64; no device sync)
  host µs         agree_batch with torch.distributed.all_reduce a no-op: its own host
                  work (median over blocks of 200 calls)
  build µs        make_decode_batch of the rank's requests (a KV slot each, the input
                  tensors; timed in the blocking arm): the engine's work between
                  start_step_agreement and forward
  block µs        blocking arm: the time in agree_batch inside runner.forward
  start µs        overlapped arm: runner.start_step_agreement (this rank's checks and
                  the issue)
  issue µs        the part of start µs in DPGroup.start_agree_batch
  preempt         the share of issues during which this thread was preempted (an
                  involuntary context switch; Linux, else 0%)
  wait µs         overlapped arm: the time forward blocks in the agreement's wait
  overlap µs      overlapped arm: start + wait per step (the median of the sums)
  step ms         one blocking runner.forward (the emulated decode step, its
                  agreement included)

columns of the second table (the agreement's share of a decode step):
  rank            the rank
  blocking        block µs / step ms (the emulated step measured here)
  overlapped      overlap µs / step ms
  blocking@ref    block µs / --step-ms
  overlapped@ref  overlap µs / --step-ms
  build+step ms b/o
                  one whole step, blocking arm (build + forward) / overlapped arm
                  (start + build + forward)
  phases s        the rank's seconds: start (spawn, imports, process group),
                  collectives (the bare collectives and agree_batch), capture (model,
                  runner, capture), steps (both arms, warm-up included), end (until
                  the parent had every rank's result)
"""


class _Done:
    """What the no-op all-reduce returns: a work already complete."""

    def wait(self, timeout: Any = None) -> bool:
        return True


def _agreed_count(dp: Any, budget_s: float, per_call_s: float, lo: int, hi: int) -> int:
    """How many calls of ``per_call_s`` fit ``budget_s`` on the slowest rank (within
    ``[lo, hi]``): the same count on every rank."""
    mine = int(budget_s / max(per_call_s, 1e-9))
    return max(lo, min(hi, dp.host_min([mine], what="the benchmark's call count")[0]))


def _grew_by_one(step: str, records: Dict[str, List[float]], before: Dict[str, int]) -> None:
    """Raise unless each of ``records`` (name: the timings the step's patched calls append)
    got exactly one entry since ``before`` (name: its length before the step): a step that
    skipped the call, or made it twice, would otherwise be read as another step's time."""
    wrong = {name: len(v) - before[name] for name, v in records.items() if len(v) != before[name] + 1}
    if wrong:
        counts = ", ".join(f"{name} +{n}" for name, n in wrong.items())
        raise RuntimeError(f"the {step} step recorded {counts} (expected exactly one of each): not timed as documented")


def _rank(tp: Any, args: Dict[str, Any]) -> Dict[str, Any]:
    import torch.distributed as dist

    from cuda_graph_runner.reference.batches import make_decode_batch
    from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM
    from cuda_graph_runner.runner import DecodeCudaGraphRunner
    from cuda_graph_runner.runner.dp_group import DPGroup, PendingAgreement
    from cuda_graph_runner_breakable.emulation import EmulatedGraphDeviceModule
    from cuda_graph_runner_full.backend import FullCudaGraphBackend

    torch.set_num_threads(1)  # the ranks share the host's cores
    phases: Dict[str, float] = {"entered_at": time.time()}
    mark = time.perf_counter()
    clock = time.perf_counter
    budget = args["budget_s"]
    dp = DPGroup.of(tp)
    size = args["bs"] if dp.rank == 0 else args["bs"] // 2
    one, five = torch.zeros(1, dtype=torch.int64), torch.zeros(5, dtype=torch.int64)
    # Every rank runs this with one graph variant (the runner's capture below checks it);
    # stated up front, so the bare agreement is the one-int64 round as after a capture.
    dp.variants_agreed(("",))

    # -- the collective alone and the blocking agreement, interleaved call by call (a
    # busy host's load drifts: calls side by side see the same load)
    timed: Dict[str, Callable[[], Any]] = {
        "floor": lambda: dist.all_reduce(one, op=dist.ReduceOp.MIN, group=dp._cpu()),
        "floor5": lambda: dist.all_reduce(five, op=dist.ReduceOp.MIN, group=dp._cpu()),
        "agree": lambda: dp.agree_batch(size, True, ""),
    }
    t0 = clock()
    for _ in range(20):  # warm-up, and the calibration of one round
        for fn in timed.values():
            fn()
    rounds = _agreed_count(dp, 0.25 * budget, (clock() - t0) / 20, 50, 4000)
    samples: Dict[str, List[float]] = {name: [] for name in timed}
    for _ in range(rounds):
        for name, fn in timed.items():
            start = clock()
            fn()
            samples[name].append(clock() - start)
    real_all_reduce = dist.all_reduce
    done = _Done()
    dist.all_reduce = lambda *a, **k: done  # type: ignore[assignment]  # this rank alone: no collective
    try:
        host = []
        for _ in range(5):
            start = clock()
            for _ in range(200):
                dp.agree_batch(size, True, "")
            host.append((clock() - start) / 200)
    finally:
        dist.all_reduce = real_all_reduce
    phases["collectives_s"], mark = clock() - mark, clock()

    # -- the runner: capture, then decode steps in the two arms
    ctx = 64
    model = ReferenceLlamaForCausalLM.from_preset(args["preset"], seed=0, dp_group=dp)
    cache = model.create_kv_cache(num_slots=size * ctx + 1, max_reqs=size + 1, max_context_len=ctx)
    backend = FullCudaGraphBackend("cpu", phase="decode", device_module=EmulatedGraphDeviceModule())
    runner = DecodeCudaGraphRunner(
        model, {"decode": {"max_bs": args["bs"]}}, device="cpu", backend=backend, show_progress=False
    )
    runner.capture()
    phases["capture_s"], mark = clock() - mark, clock()

    rows: List[int] = []

    def fresh_rows() -> None:
        # Requests whose context is full end and new ones of 16 cached tokens start
        # (untimed bookkeeping: the timed steps stay within ``ctx``).
        for r in rows:
            cache.free_request(r)
        rows[:] = [cache.alloc_request() for _ in range(size)]
        for _ in range(16):
            make_decode_batch(cache, rows, None, [1] * size)

    fresh_rows()

    def build() -> Any:
        return make_decode_batch(cache, rows, None, [1] * size)

    def refresh() -> None:
        if cache.request_len(rows[0]) >= ctx - 1:
            fresh_rows()

    # The time forward blocks in the agreement's wait (the first wait of each handle;
    # a second returns the kept result) and in the blocking agreement.
    waits: List[float] = []
    real_wait = PendingAgreement.wait

    def timed_wait(self: Any) -> Any:
        first = self._result is None and self._error is None
        start = clock()
        try:
            return real_wait(self)
        finally:
            if first:
                waits.append(clock() - start)

    blocks: List[float] = []
    real_agree = dp.agree_batch

    def timed_agree(*a: Any, **k: Any) -> Any:
        start = clock()
        try:
            return real_agree(*a, **k)
        finally:
            blocks.append(clock() - start)

    issues: List[float] = []
    real_start = dp.start_agree_batch

    preempted: List[int] = []
    thread_usage = getattr(resource, "RUSAGE_THREAD", None) if resource is not None else None

    def switches() -> int:
        return resource.getrusage(thread_usage).ru_nivcsw if thread_usage is not None else 0

    def timed_start(*a: Any, **k: Any) -> Any:
        # Whether the issue was preempted (an involuntary context switch of this thread:
        # a host without an idle core hands it to gloo's worker thread it just woke).
        before = switches()
        start = clock()
        try:
            return real_start(*a, **k)
        finally:
            issues.append(clock() - start)
            preempted.append(switches() - before)

    names = ("build", "block", "step", "start", "issue", "wait", "overlap", "total_b", "total_o")
    arms: Dict[str, List[float]] = {name: [] for name in names}

    def blocking_step(keep: bool) -> None:
        refresh()
        before = {"blocks": len(blocks)}
        t0 = clock()
        batch = build()
        t1 = clock()
        dp.agree_batch = timed_agree  # type: ignore[method-assign]
        try:
            runner.forward(batch)
        finally:
            del dp.agree_batch
        t2 = clock()
        _grew_by_one("blocking", {"blocks": blocks}, before)
        if keep:
            arms["build"].append(t1 - t0)
            arms["step"].append(t2 - t1)
            arms["total_b"].append(t2 - t0)
            arms["block"].append(blocks[-1])

    def overlapped_step(keep: bool) -> None:
        refresh()
        before = {"issues": len(issues), "waits": len(waits)}
        t0 = clock()
        dp.start_agree_batch = timed_start  # type: ignore[method-assign]
        try:
            runner.start_step_agreement(size)
        finally:
            del dp.start_agree_batch
        t1 = clock()
        batch = build()
        PendingAgreement.wait = timed_wait  # type: ignore[method-assign]
        try:
            runner.forward(batch)
        finally:
            PendingAgreement.wait = real_wait  # type: ignore[method-assign]
        t2 = clock()
        _grew_by_one("overlapped", {"issues": issues, "waits": waits}, before)
        if keep:
            arms["start"].append(t1 - t0)
            arms["issue"].append(issues[-1])
            arms["wait"].append(waits[-1])
            arms["overlap"].append(t1 - t0 + waits[-1])
            arms["total_o"].append(t2 - t0)

    t0 = clock()
    for _ in range(3):  # warm-up, and the calibration of one pair of steps
        blocking_step(False)
        overlapped_step(False)
    steps = _agreed_count(dp, 0.5 * budget, (clock() - t0) / 3, 10, 1000)
    for _ in range(steps):
        blocking_step(True)
        overlapped_step(True)
    phases["steps_s"] = clock() - mark
    phases["left_at"] = time.time()

    def med_us(values: List[float]) -> float:
        return statistics.median(values) * 1e6

    out = {name: med_us(v) for name, v in arms.items()}
    return {
        "rank": dp.rank,
        "live_bs": size,
        "rounds": rounds,
        "steps": steps,
        "floor_us": med_us(samples["floor"]),
        "floor5_us": med_us(samples["floor5"]),
        "agree_us": med_us(samples["agree"]),
        "host_us": med_us(host),
        "build_us": out["build"],
        "block_us": out["block"],
        "start_us": out["start"],
        "issue_us": out["issue"],
        "issue_preempted": sum(1 for n in preempted[-len(arms["issue"]) :] if n) / max(1, len(arms["issue"])),
        "wait_us": out["wait"],
        "overlap_us": out["overlap"],
        "step_ms": out["step"] / 1e3,
        "step_total_blocking_ms": out["total_b"] / 1e3,
        "step_total_overlapped_ms": out["total_o"] / 1e3,
        "replays": sum(runner.stats.replays_by_size.values()),
        "fallbacks": sum(runner.stats.fallbacks.values()),
        "phases_s": phases,
    }


def main(argv: Optional[List[str]] = None) -> int:
    from cuda_graph_runner.config.integers import count_arg
    from cuda_graph_runner.reference.model import PRESETS
    from cuda_graph_runner.testing.tp_launch import run_ranks

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=COLUMNS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dp", type=count_arg(2), default=2, help="ranks, one gloo process each (default 2)")
    parser.add_argument("--preset", default="tiny", help="the reference model's preset (default tiny)")
    parser.add_argument("--bs", type=count_arg(2), default=8, help="rank 0's requests (the others: half; default 8)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=16.0,
        help="seconds the timed parts may take together (a quarter for the bare collectives, half for the "
        "steps; default 16)",
    )
    parser.add_argument(
        "--step-ms",
        type=float,
        default=REFERENCE_STEP_MS,
        help=f"the decode step (ms) the share is also given against (default: {REFERENCE_STEP})",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        help="seconds the whole run may take before every rank is killed (default: 3 x --budget-s + 120)",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results document here")
    args = parser.parse_args(argv)
    if args.preset not in PRESETS:
        parser.error(f"--preset {args.preset!r}: accepted {', '.join(sorted(PRESETS))}")
    if not 1.0 <= args.budget_s <= 300.0:
        parser.error(f"--budget-s {args.budget_s}: accepted 1 to 300 seconds")
    if args.timeout_s is None:
        args.timeout_s = args.budget_s * 3 + 120
    if not (math.isfinite(args.timeout_s) and args.timeout_s > 0):
        parser.error(f"--timeout-s {args.timeout_s}: accepted a finite number of seconds > 0")
    if not args.step_ms > 0:
        parser.error(f"--step-ms {args.step_ms}: accepted a positive number of milliseconds")
    began = time.time()
    ranks = run_ranks(_rank, args.dp, vars(args), timeout_s=args.timeout_s, group_timeout_s=60)
    ended = time.time()
    wall = ended - began
    for r in ranks:  # the ranks' start (spawn, imports, process group) and end, from here
        entered, left = r["phases_s"].pop("entered_at"), r["phases_s"].pop("left_at")
        r["phases_s"] = {"start_s": entered - began, **r["phases_s"], "end_s": ended - left}
    print(f"DP={args.dp} on the CPU (gloo), preset {args.preset}, torch {torch.__version__}, {wall:.1f} s in all")
    print(
        f"{'rank':>4} {'live bs':>7} {'floor µs':>9} {'floor5 µs':>9} {'agree µs':>9} {'host µs':>8} {'build µs':>9}"
        f" {'block µs':>9} {'start µs':>9} {'issue µs':>9} {'preempt':>7} {'wait µs':>8} {'overlap µs':>10} {'step ms':>8}"
    )
    for r in ranks:
        print(
            f"{r['rank']:>4} {r['live_bs']:>7} {r['floor_us']:>9.1f} {r['floor5_us']:>9.1f} {r['agree_us']:>9.1f} {r['host_us']:>8.1f}"
            f" {r['build_us']:>9.1f} {r['block_us']:>9.1f} {r['start_us']:>9.1f} {r['issue_us']:>9.1f} {r['issue_preempted']:>7.0%} {r['wait_us']:>8.1f}"
            f" {r['overlap_us']:>10.1f} {r['step_ms']:>8.2f}"
        )
    print(
        f"share of a decode step (target <= {TARGET_SHARE:.0%}; host cost target <= {TARGET_US} µs): "
        f"the emulated step here, and {args.step_ms:g} ms"
        + (f" ({REFERENCE_STEP})" if args.step_ms == REFERENCE_STEP_MS else "")
    )
    print(
        f"{'rank':>4} {'blocking':>9} {'overlapped':>10} {'blocking@ref':>12} {'overlapped@ref':>14}"
        f" {'build+step ms b/o':>17}  phases s"
    )
    for r in ranks:
        step_us = r["step_ms"] * 1e3
        r["share_blocking"] = r["block_us"] / step_us
        r["share_overlapped"] = r["overlap_us"] / step_us
        r["share_blocking_ref"] = r["block_us"] / (args.step_ms * 1e3)
        r["share_overlapped_ref"] = r["overlap_us"] / (args.step_ms * 1e3)
        phases = " ".join(f"{k[:-2]} {v:.1f}" for k, v in r["phases_s"].items())
        totals = f"{r['step_total_blocking_ms']:.2f}/{r['step_total_overlapped_ms']:.2f}"
        print(
            f"{r['rank']:>4} {r['share_blocking']:>9.2%} {r['share_overlapped']:>10.2%}"
            f" {r['share_blocking_ref']:>12.2%} {r['share_overlapped_ref']:>14.2%} {totals:>17}  {phases}"
        )
    print(
        "build: make_decode_batch of the rank's requests (a KV slot each, the input tensors), the engine's work "
        "between start_step_agreement and forward; block: agree_batch inside forward; start + wait: the "
        f"overlapped agreement's host cost; {ranks[0]['rounds']} collective rounds, {ranks[0]['steps']} steps per arm"
    )
    floor = max(r["floor_us"] for r in ranks)
    if floor > TARGET_US:
        print(
            f"the bare gloo all-reduce costs {floor:.0f} µs here, above the {TARGET_US} µs target for the whole "
            "agreement: a shared or busy host (agree/floor, the overlapped wait and preempt are the measures here)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "dp": args.dp,
                    "preset": args.preset,
                    "torch": torch.__version__,
                    "bs": args.bs,
                    "budget_s": args.budget_s,
                    "wall_s": wall,
                    "target_us": TARGET_US,
                    "target_share": TARGET_SHARE,
                    "step_ms_ref": args.step_ms,
                    "step_ref": REFERENCE_STEP if args.step_ms == REFERENCE_STEP_MS else "--step-ms",
                    "build": "make_decode_batch (KV slot per request, input tensors)",
                    "ranks": ranks,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
