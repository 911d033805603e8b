#!/usr/bin/env python3
"""Host time of ``replay_prepare`` (and of a whole ``replay``) per step (µs), on any device.

A micro-benchmark of the runner's per-step host work only: copying a live batch into the
static buffers (padded to the captured size) and building the static batch. No graph is
captured: the runners hold the CPU ``RecordingBackend`` (or, with ``--device cuda``, the
same with the buffers on the GPU), and a tiny model without parameters worth timing, so
what is timed is the runner's Python and the copy launches.

For each case the median over ``--repeats`` blocks of ``--iters`` calls is printed (µs per
call), plus the min; ``--json PATH`` writes them. Cases: decode at a steady batch size on a
bucket (8 of 8), off a bucket (5 of 8, padded), alternating sizes within a bucket (the
padding refill path), prefill at a steady token count (also with request slots, prefill
``full``: the request axis copied into slot buffers, host lists padded), and a whole decode ``replay`` (prepare,
the backend's replay of a stored output, slicing: the runner's per-step host path, profiler
range check included). Compare two checkouts in one run by pointing ``PYTHONPATH`` at each
checkout's ``core`` in turn, or by running this script in each (``git stash`` / another
worktree); on CUDA the numbers include the kernel launches of the copies.

Usage::

    python benchmarks/replay_prepare.py                      # CPU
    python benchmarks/replay_prepare.py --device cuda --json $OUT/replay_prepare.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from typing import Any, Callable, Dict, List

import torch

from cuda_graph_runner.bench_measure import block_means_s
from cuda_graph_runner.forward_batch import ForwardBatch, ForwardMode
from cuda_graph_runner.integers import count_arg
from cuda_graph_runner.runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner
from cuda_graph_runner.testing.fakes import RecordingBackend


class _StoredOutputBackend(RecordingBackend):
    """Replays by returning the captured output: what is timed is the runner's side."""

    def replay(self, key: Any, static_batch: ForwardBatch) -> Any:
        return self._outputs[key]


class _Model(torch.nn.Module):
    """Honours the model protocol; only its device matters here."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1, device=device), requires_grad=False)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return batch.input_ids.float()[:, None] + self.w

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return hidden


class _PlannedModel(_Model):
    """With a replay hook that plans nothing: a prefill runner with request slots needs one."""

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        return None


class _RecordsMarkedOps(RecordingBackend):
    """Declares what ``full`` declares, so the prefill runner fixes its request slots."""

    records_marked_ops = True


def _decode_batch(bs: int, device: str) -> ForwardBatch:
    seq = torch.arange(bs, dtype=torch.int32) + 7
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        input_ids=torch.arange(bs, device=device) + 1,
        positions=torch.arange(bs, device=device) + 3,
        out_cache_loc=torch.arange(bs, device=device) + 9,
        req_pool_indices=torch.arange(bs, device=device) + 1,
        seq_lens=seq.to(device),
        seq_lens_cpu=seq.tolist(),
    )


def _extend_batch(lengths: List[int], device: str) -> ForwardBatch:
    tokens = sum(lengths)
    n = len(lengths)
    lens = torch.tensor(lengths, dtype=torch.int32)
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        input_ids=torch.arange(tokens, device=device) + 1,
        positions=torch.arange(tokens, device=device),
        out_cache_loc=torch.arange(tokens, device=device) + 1,
        req_pool_indices=torch.arange(n, device=device) + 1,
        seq_lens=lens.to(device),
        extend_seq_lens=lens.to(device),
        extend_prefix_lens=torch.zeros(n, dtype=torch.int32, device=device),
        seq_lens_cpu=list(lengths),
        extend_seq_lens_cpu=list(lengths),
        extend_prefix_lens_cpu=[0] * n,
    )


def time_us(fn: Callable[[], Any], *, iters: int, repeats: int, sync: Callable[[], None]) -> Dict[str, float]:
    """Median and min over ``repeats`` blocks of the mean host µs per call of ``fn``."""
    samples = [
        s * 1e6 for s in block_means_s(fn, iters=iters, warmup=iters, sync=sync, repeats=repeats, host_only=True)
    ]
    return {"median_us": statistics.median(samples), "min_us": min(samples)}


def run(device: str, iters: int, repeats: int) -> Dict[str, Dict[str, float]]:
    model = _Model(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    decode = DecodeCudaGraphRunner(
        model, {"decode": {"bs": [1, 2, 4, 8, 16], "max_bs": 16}}, backend=RecordingBackend(device), show_progress=False
    )
    prefill = PrefillCudaGraphRunner(
        model,
        {"prefill": {"bs": [64, 128], "max_bs": 128}},
        backend=RecordingBackend(device, phase="prefill"),
        show_progress=False,
    )
    replayer = DecodeCudaGraphRunner(
        model,
        {"decode": {"bs": [1, 2, 4, 8, 16], "max_bs": 16}},
        backend=_StoredOutputBackend(device),
        show_progress=False,
    )
    replayer.capture()
    slotted = PrefillCudaGraphRunner(
        _PlannedModel(device),
        {"prefill": {"bs": [64, 128], "max_bs": 128, "full_prefill_max_req": 4}},
        backend=_RecordsMarkedOps(device, phase="prefill"),
        show_progress=False,
    )
    b8, b5, b7 = (_decode_batch(n, device) for n in (8, 5, 7))
    p100 = _extend_batch([40, 30, 30], device)
    alternating = iter(())

    def alternate() -> Any:
        nonlocal alternating
        try:
            return decode.replay_prepare(next(alternating))
        except StopIteration:
            alternating = iter([b5, b7] * 64)
            return decode.replay_prepare(next(alternating))

    cases = {
        "decode bs=8 (on a bucket)": lambda: decode.replay_prepare(b8),
        "decode bs=5 (padded to 8)": lambda: decode.replay_prepare(b5),
        "decode bs=5/7 alternating (padded to 8)": alternate,
        "prefill 100 tokens, 3 requests (padded to 128)": lambda: prefill.replay_prepare(p100),
        "decode replay bs=5 (prepare + replay + slice)": lambda: replayer.replay(b5),
        "prefill 100 tokens, 3 requests in 4 request slots (full)": lambda: slotted.replay_prepare(p100),
    }
    gc.collect()
    gc.freeze()
    try:
        with torch.no_grad():
            return {name: time_us(fn, iters=iters, repeats=repeats, sync=sync) for name, fn in cases.items()}
    finally:
        gc.unfreeze()


def main(argv: "List[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--iters", type=count_arg(1), default=2000, help="calls per timed block (default 2000)")
    parser.add_argument(
        "--repeats", type=count_arg(1), default=7, help="timed blocks; the median is reported (default 7)"
    )
    parser.add_argument("--json", dest="json_path", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    results = run(args.device, args.iters, args.repeats)
    width = max(len(n) for n in results)
    print(f"replay_prepare host time per step on {args.device} (torch {torch.__version__})")
    for name, r in results.items():
        print(f"  {name.ljust(width)}  median {r['median_us']:7.2f} µs   min {r['min_us']:7.2f} µs")
    if args.json_path:
        with open(args.json_path, "w") as f:
            gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
            doc = {"device": args.device, "gpu": gpu, "torch": torch.__version__, "results": results}
            json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
