#!/usr/bin/env python3
"""Host cost of the data-parallel step agreement, and its share of a decode step (CPU, gloo).

Spawns ``--dp`` ranks on this host (:func:`cuda_graph_runner.testing.tp_launch.run_ranks`:
bounded in time, gloo). On each rank, in one run:

* ``agree µs``: one :meth:`cuda_graph_runner.runner.dp_group.DPGroup.agree_batch` (the
  per-step host all-reduce of five int64s, no device sync), ragged live sizes;
* ``step ms``: one decode step of the reference model's DP layout through
  ``runner.forward`` (agreement, padding to the largest batch, the replay of the
  ``full`` backend on emulated CPU graphs: the model's work, collectives included);
  rank 0 holds ``--bs`` requests, the others ``--bs // 2`` (padded up);
* ``share``: ``agree µs / step ms``;
* ``floor µs``: one bare gloo all-reduce of one int64 on the same group (what any
  per-step host agreement costs at least), and ``agree/floor``: the agreement's cost in
  floors (1.0: all of it is the collective's latency). Where gloo's own latency is above
  the agreement's target (a shared or busy host), this ratio is the measure;
* ``host µs``: the agreement's own host work, its collective left out (one
  ``agree_batch`` with ``torch.distributed.all_reduce`` replaced by a no-op: the values
  packed, the result read back and decided);
* ``issue µs`` / ``wait µs`` / ``overlap µs``: the overlapped agreement
  (:meth:`~cuda_graph_runner.runner.dp_group.DPGroup.start_agree_batch`, an
  ``async_op=True`` all-reduce) started before a batch-building workload and waited on
  after it: the time the caller spends issuing it, the time it is blocked waiting once
  the workload is done, and their sum (the overlapped host cost; ``overlap/agree``: its
  ratio to the blocking agreement). One row per workload of ``--builds``: ``n`` times the
  reference ``ForwardBatch`` preparation of the rank's live batch (its tensors from the
  host's lists, as an engine builds its step's input tensors; ``build µs`` is its time
  alone, measured in the same run);
* ``tp µs``: the tensor-parallel per-batch agreement
  (:meth:`~cuda_graph_runner.runner.distributed.TPGroup.agree_step`) on the same group, for
  comparison.

``agree``, ``floor``, ``tp``, ``build`` and the overlapped parts are the medians of
``--iters * --repeats`` calls each, interleaved call by call so that all see the same load; ``host`` and ``step`` the
medians over ``--repeats`` blocks of ``--iters`` calls (every rank runs the same counts:
the calls are collectives). Usage::

    python benchmarks/dp_agreement.py                 # DP=2, preset tiny, bs 8
    python benchmarks/dp_agreement.py --json $OUT/dp_agreement.json
    python benchmarks/dp_agreement.py --builds 1 16   # workloads: 1 and 16 batch preparations
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Dict

import torch

#: The per-step agreement's target host cost (µs), the bare collective's included.
TARGET_US = 100


class _Done:
    """What the no-op all-reduce returns: a work already complete."""

    def wait(self, timeout: Any = None) -> bool:
        return True


def _prepare_batch(size: int, step: int) -> Any:
    """The reference decode ``ForwardBatch`` preparation of ``size`` requests at context
    ``step`` (what :func:`cuda_graph_runner.reference.batches.make_decode_batch` builds,
    without the KV cache's slot allocation): each input tensor from the host's lists."""
    from cuda_graph_runner.backend.forward_batch import ForwardBatch, ForwardMode

    rows = list(range(1, size + 1))
    lens = [step + 1] * size
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        input_ids=torch.tensor([(7 * r + step) % 97 for r in rows], dtype=torch.int64),
        positions=torch.tensor([step] * size, dtype=torch.int64),
        out_cache_loc=torch.tensor([64 * r + step for r in rows], dtype=torch.int64),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        seq_lens_cpu=lens,
    )


def _rank(tp: Any, args: Dict[str, Any]) -> Dict[str, Any]:
    from cuda_graph_runner.cli.bench.measure import block_means_s
    from cuda_graph_runner.reference.batches import make_decode_batch
    from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM
    from cuda_graph_runner.runner import DecodeCudaGraphRunner
    from cuda_graph_runner.runner.dp_group import DPGroup
    from cuda_graph_runner_breakable.emulation import EmulatedGraphDeviceModule
    from cuda_graph_runner_full.backend import FullCudaGraphBackend

    torch.set_num_threads(1)  # the ranks share the host's cores
    dp = DPGroup.of(tp)
    no_sync = lambda: None  # noqa: E731 - host only: the CPU has no queue to drain
    iters, repeats = args["iters"], args["repeats"]
    size = args["bs"] if dp.rank == 0 else args["bs"] // 2
    import torch.distributed as dist

    from cuda_graph_runner.backend import ShapeKey

    one = torch.zeros(1, dtype=torch.int64)
    key = ShapeKey(args["bs"], "decode")
    builds = args["builds"]

    def build(n: int) -> None:
        for step in range(n):
            _prepare_batch(size, step)

    timed = {
        "floor": lambda: dist.all_reduce(one, op=dist.ReduceOp.MIN, group=dp._cpu()),
        "tp": lambda: tp.agree_step(args["bs"], True, key),
        "agree": lambda: dp.agree_batch(size, True, ""),
    }
    for n in builds:
        timed[f"build{n}"] = lambda n=n: build(n)
    # Interleaved call by call (floor, tp, agree, build, overlapped, floor, ...), each
    # call timed: a busy host's load drifts over a block's milliseconds, so blocks of one
    # kind each saw another load; the medians of calls side by side saw the same.
    samples: Dict[str, list] = {name: [] for name in timed}
    for n in builds:
        samples[f"issue{n}"], samples[f"wait{n}"], samples[f"overlap{n}"] = [], [], []
    clock = time.perf_counter
    for i in range(20 + iters * repeats):
        for name, fn in timed.items():
            start = clock()
            fn()
            if i >= 20:  # warm-up calls untimed
                samples[name].append(clock() - start)
        for n in builds:  # the overlapped agreement around n batch preparations
            t0 = clock()
            pending = dp.start_agree_batch(size, True, "")
            t1 = clock()
            build(n)
            t2 = clock()
            pending.wait()
            t3 = clock()
            if i >= 20:
                samples[f"issue{n}"].append(t1 - t0)
                samples[f"wait{n}"].append(t3 - t2)
                samples[f"overlap{n}"].append(t1 - t0 + t3 - t2)
    agree = samples["agree"]
    real_all_reduce = dist.all_reduce
    done = _Done()
    dist.all_reduce = lambda *a, **k: done  # type: ignore[assignment]  # this rank alone: no collective
    try:
        host = block_means_s(
            lambda: dp.agree_batch(size, True, ""), iters=iters, warmup=20, sync=no_sync, repeats=repeats
        )
    finally:
        dist.all_reduce = real_all_reduce

    model = ReferenceLlamaForCausalLM.from_preset(args["preset"], seed=0, dp_group=dp)
    cache = model.create_kv_cache(num_slots=4 * args["bs"] * 64 + 1, max_reqs=args["bs"] + 1, max_context_len=64)
    backend = FullCudaGraphBackend("cpu", phase="decode", device_module=EmulatedGraphDeviceModule())
    runner = DecodeCudaGraphRunner(
        model, {"decode": {"max_bs": args["bs"]}}, device="cpu", backend=backend, show_progress=False
    )
    runner.capture()
    rows = [cache.alloc_request() for _ in range(size)]
    for _ in range(16):  # 16 cached tokens per request; the timed step reuses the last batch
        batch = make_decode_batch(cache, rows, None, [1] * size) if size else None
    step = block_means_s(
        lambda: runner.forward(batch), iters=max(1, iters // 50), warmup=3, sync=no_sync, repeats=repeats
    )
    us = {name: statistics.median(v) * 1e6 for name, v in samples.items()}
    return {
        "rank": dp.rank,
        "live_bs": size,
        "overlapped": [
            {
                "builds": n,
                "build_us": us[f"build{n}"],
                "issue_us": us[f"issue{n}"],
                "wait_us": us[f"wait{n}"],
                "overlap_us": us[f"overlap{n}"],
            }
            for n in builds
        ],
        "agree_us": statistics.median(agree) * 1e6,
        "floor_us": statistics.median(samples["floor"]) * 1e6,
        "host_us": statistics.median(host) * 1e6,
        "tp_us": statistics.median(samples["tp"]) * 1e6,
        "step_ms": statistics.median(step) * 1e3,
        "replays": sum(runner.stats.replays_by_size.values()),
    }


def main() -> int:
    from cuda_graph_runner.config.integers import count_arg
    from cuda_graph_runner.testing.tp_launch import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=count_arg(2), default=2)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--bs", type=count_arg(2), default=8, help="rank 0's requests (the others: half)")
    parser.add_argument("--iters", type=count_arg(1), default=2000)
    parser.add_argument("--repeats", type=count_arg(1), default=5)
    parser.add_argument(
        "--builds",
        type=count_arg(1),
        nargs="+",
        default=[1, 8],
        help="batch-building workloads for the overlapped agreement: this many ForwardBatch preparations each",
    )
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args()
    ranks = run_ranks(_rank, args.dp, vars(args), timeout_s=600, group_timeout_s=60)
    print(f"DP={args.dp} on the CPU (gloo), preset {args.preset}, torch {torch.__version__}")
    print(
        f"{'rank':>4} {'live bs':>7} {'agree µs':>9} {'step ms':>8} {'share':>7} {'floor µs':>9}"
        f" {'agree/floor':>11} {'host µs':>8} {'tp µs':>7}"
    )
    for r in ranks:
        r["share"] = r["agree_us"] / (r["step_ms"] * 1e3)
        r["agree_over_floor"] = r["agree_us"] / r["floor_us"]
        print(
            f"{r['rank']:>4} {r['live_bs']:>7} {r['agree_us']:>9.1f} {r['step_ms']:>8.2f} {r['share']:>7.2%}"
            f" {r['floor_us']:>9.1f} {r['agree_over_floor']:>10.2f}x {r['host_us']:>8.1f} {r['tp_us']:>7.1f}"
        )
    print("overlapped agreement (started before the batch building, waited on after it; µs blocked):")
    print(
        f"{'rank':>4} {'builds':>6} {'build µs':>9} {'issue µs':>9} {'wait µs':>8} {'overlap µs':>10}"
        f" {'agree µs':>9} {'overlap/agree':>13} {'share':>7}"
    )
    for r in ranks:
        for o in r["overlapped"]:
            o["overlap_over_agree"] = o["overlap_us"] / r["agree_us"]
            o["share"] = o["overlap_us"] / (r["step_ms"] * 1e3)
            print(
                f"{r['rank']:>4} {o['builds']:>6} {o['build_us']:>9.1f} {o['issue_us']:>9.1f} {o['wait_us']:>8.1f}"
                f" {o['overlap_us']:>10.1f} {r['agree_us']:>9.1f} {o['overlap_over_agree']:>12.2f}x {o['share']:>7.2%}"
            )
    floor = max(r["floor_us"] for r in ranks)
    if floor > TARGET_US:
        print(
            f"the bare gloo all-reduce costs {floor:.0f} µs here, above the {TARGET_US} µs target for the whole "
            "agreement: agree/floor is the measure on this host"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "dp": args.dp,
                    "preset": args.preset,
                    "torch": torch.__version__,
                    "builds": args.builds,
                    "target_us": TARGET_US,
                    "ranks": ranks,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
