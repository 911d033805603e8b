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
range check included), and a whole decode ``forward`` (the decision, then the replay). On
CUDA the numbers include the kernel launches of the copies.

``--against CHECKOUT`` compares two checkouts in one run: the same cases (this script's)
built on this checkout's package and on ``CHECKOUT/core``'s, in two worker processes timed
block by block in alternation (process CPU time, so load on a shared machine falls on
both alike); it prints each side's median and the median of the paired ratios B/A (B:
this checkout). Find a host-time regression this way, e.g. against a ``git worktree add``
of the commit of a stored result.

Usage::

    python benchmarks/replay_prepare.py                      # CPU
    python benchmarks/replay_prepare.py --device cuda --json $OUT/replay_prepare.json
    python benchmarks/replay_prepare.py --against ../old-checkout --repeats 11
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

import torch

from cuda_graph_runner.runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner
from cuda_graph_runner.testing.fakes import RecordingBackend

try:
    from cuda_graph_runner.backend.forward_batch import ForwardBatch, ForwardMode
    from cuda_graph_runner.cli.bench.measure import block_means_s
    from cuda_graph_runner.config.integers import count_arg
except ImportError:  # --against a checkout with the modules at the package's top level
    from cuda_graph_runner.bench_measure import block_means_s  # type: ignore[no-redef]  # flat layout
    from cuda_graph_runner.forward_batch import ForwardBatch, ForwardMode  # type: ignore[no-redef]  # flat layout
    from cuda_graph_runner.integers import count_arg  # type: ignore[no-redef]  # flat layout


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


def build_cases(device: str) -> Dict[str, Callable[[], Any]]:
    """The timed cases, each a no-argument call, built on the package that is imported
    (a case whose runner this package cannot build, such as request slots on a checkout
    without them, is left out)."""
    model = _Model(device)
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
    try:
        slotted: Any = PrefillCudaGraphRunner(
            _PlannedModel(device),
            {"prefill": {"bs": [64, 128], "max_bs": 128, "full_prefill_max_req": 4}},
            backend=_RecordsMarkedOps(device, phase="prefill"),
            show_progress=False,
        )
    except (TypeError, ValueError):  # a checkout without request slots (--against an older one)
        slotted = None
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
        "decode forward bs=5 (decide + replay)": lambda: replayer.forward(b5),
    }
    if slotted is not None:
        cases["prefill 100 tokens, 3 requests in 4 request slots (full)"] = lambda: slotted.replay_prepare(p100)
    return cases


def _sync_of(device: str) -> Callable[[], None]:
    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def run(device: str, iters: int, repeats: int) -> Dict[str, Dict[str, float]]:
    sync = _sync_of(device)
    cases = build_cases(device)
    gc.collect()
    gc.freeze()
    try:
        with torch.no_grad():
            return {name: time_us(fn, iters=iters, repeats=repeats, sync=sync) for name, fn in cases.items()}
    finally:
        gc.unfreeze()


def _worker(device: str) -> int:
    """``--worker``: build the cases on the package that is imported, then time blocks on
    request (stdin ``<case index> <iters>`` per line; stdout one line each, the mean
    process CPU µs per call of that block, or ``nan`` for a case this checkout lacks)."""
    import cuda_graph_runner

    sync = _sync_of(device)
    cases = build_cases(device)
    gc.collect()
    gc.freeze()
    torch.set_grad_enabled(False)
    for fn in cases.values():
        for _ in range(200):
            fn()
    names = list(_case_names())
    print(json.dumps({"package": os.path.dirname(cuda_graph_runner.__file__)}), flush=True)
    for line in sys.stdin:
        index, iters = (int(x) for x in line.split())
        fn = cases.get(names[index])
        if fn is None:
            print("nan", flush=True)
            continue
        sync()
        start = time.process_time()
        for _ in range(iters):
            fn()
        spent = time.process_time() - start
        sync()
        print(spent / iters * 1e6, flush=True)
    return 0


def _case_names() -> List[str]:
    return [
        "decode bs=8 (on a bucket)",
        "decode bs=5 (padded to 8)",
        "decode bs=5/7 alternating (padded to 8)",
        "prefill 100 tokens, 3 requests (padded to 128)",
        "decode replay bs=5 (prepare + replay + slice)",
        "decode forward bs=5 (decide + replay)",
        "prefill 100 tokens, 3 requests in 4 request slots (full)",
    ]


def compare(other: str, device: str, iters: int, repeats: int) -> Dict[str, Dict[str, float]]:
    """``--against OTHER``: the cases on this checkout's package (B) and on ``OTHER``'s
    (A, a checkout root whose ``core/`` holds the package), in two worker processes
    timed in alternation (block by block, A first and B first in turn), so load on a
    shared machine falls on both alike. Per case: each side's median µs per call and
    the median of the paired ratios B/A.

    Raises:
        ValueError: ``OTHER`` has no ``core/cuda_graph_runner``; a worker imported its
            package from elsewhere than the checkout it was started for.
    """
    import subprocess

    mine = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sides = []
    for root in (os.path.abspath(other), mine):
        core = os.path.join(root, "core")
        if not os.path.isdir(os.path.join(core, "cuda_graph_runner")):
            raise ValueError(f"--against {root!r}: no core/cuda_graph_runner there (give a checkout's root)")
        env = dict(os.environ, PYTHONPATH=core + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", "--device", device],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert proc.stdout is not None
        first = proc.stdout.readline()
        package = json.loads(first)["package"] if first else ""
        if not package.startswith(os.path.join(core, "")):
            raise ValueError(f"the worker for {root!r} imported cuda_graph_runner from {package!r}, not from {core!r}")
        sides.append(proc)

    def block(proc: Any, index: int) -> float:
        proc.stdin.write(f"{index} {iters}\n")
        proc.stdin.flush()
        return float(proc.stdout.readline())

    names = _case_names()
    samples: Dict[str, List[List[float]]] = {name: [[], []] for name in names}
    try:
        for r in range(repeats):
            for index, name in enumerate(names):
                for side in (0, 1) if r % 2 == 0 else (1, 0):
                    samples[name][side].append(block(sides[side], index))
    finally:
        for proc in sides:
            proc.stdin.close()
            proc.wait()
    out = {}
    for name, (a, b) in samples.items():
        if any(v != v for v in a + b):  # nan: a case one checkout lacks
            continue
        out[name] = {
            "a_median_us": statistics.median(a),
            "b_median_us": statistics.median(b),
            "b_over_a": statistics.median(y / x for x, y in zip(a, b)),
        }
    return out


def main(argv: "List[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--iters", type=count_arg(1), default=2000, help="calls per timed block (default 2000)")
    parser.add_argument(
        "--repeats", type=count_arg(1), default=7, help="timed blocks; the median is reported (default 7)"
    )
    parser.add_argument("--json", dest="json_path", default=None, help="write the results as JSON here")
    parser.add_argument(
        "--against",
        metavar="CHECKOUT",
        default=None,
        help="also time another checkout (its root) in alternation with this one; prints medians and B/A ratios",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    if args.worker:
        return _worker(args.device)
    if args.against is not None:
        try:
            compared = compare(args.against, args.device, args.iters, args.repeats)
        except ValueError as exc:
            print(f"--against: {exc}", file=sys.stderr)
            return 2
        width = max(len(n) for n in compared)
        print(f"process CPU µs per call, A = {args.against}, B = this checkout, on {args.device}")
        for name, r in compared.items():
            print(
                f"  {name.ljust(width)}  A {r['a_median_us']:7.2f}  B {r['b_median_us']:7.2f}  B/A {r['b_over_a']:.3f}"
            )
        if args.json_path:
            with open(args.json_path, "w") as f:
                json.dump({"device": args.device, "torch": torch.__version__, "compare": compared}, f, indent=2)
        return 0
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
