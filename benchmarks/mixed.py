#!/usr/bin/env python3
"""A mixed step in one graph against the same step as a breakable prefill plus a decode replay.

The step: one prefill chunk (``--chunk`` tokens, default 256, of a new request) beside
``--decodes`` running requests' decodes (default 31, each over a ``--prefix``-token
cached prefix). Methods, each timed on the same step in every round (rounds alternate the
methods, so a drift of the machine falls on all alike):

* ``mixed_full``: the whole step as one EXTEND batch (decodes as one-token extends)
  replayed by :class:`~cuda_graph_runner.runner.MixedCudaGraphRunner` on backend ``full``
  (one CUDA graph of key ``(decodes + 1) x (chunk + decodes)``; needs an attention that
  re-plans outside the graph: ``triton``);
* ``mixed_breakable``: the same batch on the mixed runner with backend ``breakable``;
* ``separate``: the chunk through a ``PrefillCudaGraphRunner`` on ``breakable`` (its
  token bucket exactly the chunk), then the decodes through a ``DecodeCudaGraphRunner``
  on ``full`` (batch size exactly ``--decodes``): two forwards, the weights read twice.

Printed and written (``--json PATH``): per method the median and min over ``--repeats``
rounds of the mean step time of ``--iters`` steps (ms), and the ratios ``mixed_full /
separate`` and ``mixed_breakable / separate`` (median and range of the per-round
ratios). The target of a mixed step in one graph is ``mixed_full / separate <= 0.8``
(llama-3.2-1b bf16 on an H200); it is reported, not asserted.

Usage::

    python benchmarks/mixed.py --json $OUT/mixed.json                 # CUDA: llama-3.2-1b bf16, triton
    python benchmarks/mixed.py --preset tiny --device cpu --iters 2   # CPU smoke run (emulated graphs)

On the CPU the graphs are the breakable plugin's emulated graphs (a replay re-runs the
recorded ops) and the attention ``planned_standin``: the run checks the script, its
numbers mean nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from cuda_graph_runner.reference.batches import make_decode_batch, make_dummy_prompts, make_extend_batch
from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM
from cuda_graph_runner.runner import DecodeCudaGraphRunner, MixedCudaGraphRunner, PrefillCudaGraphRunner

TARGET = 0.8
METHODS = ("mixed_full", "mixed_breakable", "separate")


def _backend(name: str, phase: str, device: torch.device, emulated: Any) -> Any:
    """A backend name for the registry on a GPU; on the CPU an instance on emulated graphs."""
    if emulated is None:
        return name
    if name == "full":
        from cuda_graph_runner_full.backend import FullCudaGraphBackend as cls
    else:
        from cuda_graph_runner_breakable.backend import BreakableCudaGraphBackend as cls
    return cls("cpu", phase=phase, device_module=emulated, memory_pool=emulated.pool_handle)


def build(args: argparse.Namespace) -> Dict[str, Any]:
    """The model, the runners (captured) and the step's batches."""
    device = torch.device(args.device)
    emulated = None
    if device.type == "cpu":
        from cuda_graph_runner_breakable.emulation import EmulatedGraphDeviceModule

        emulated = EmulatedGraphDeviceModule()
    dtype = getattr(torch, args.dtype)
    attention = args.attention or ("triton" if device.type == "cuda" else "planned_standin")
    model = ReferenceLlamaForCausalLM.from_preset(args.preset, dtype=dtype, device=str(device), attention=attention)
    context = args.prefix + args.chunk + 16
    requests = args.decodes + 3
    model.create_kv_cache(num_slots=requests * context + 1, max_reqs=requests + 1, max_context_len=context)
    cache = model.kv_cache
    vocab = model.config.vocab_size
    tokens, reqs = args.chunk + args.decodes, args.decodes + 1
    mixed_config = {"prefill": {"mixed_tokens": [tokens], "mixed_requests": [reqs]}}
    common: Dict[str, Any] = {"show_progress": False, **({"device": "cpu"} if emulated is not None else {})}
    runners = {
        "mixed_full": MixedCudaGraphRunner(
            model, mixed_config, backend=_backend("full", "prefill", device, emulated), **common
        ),
        "mixed_breakable": MixedCudaGraphRunner(
            model, mixed_config, backend=_backend("breakable", "prefill", device, emulated), **common
        ),
        "prefill": PrefillCudaGraphRunner(
            model,
            {"prefill": {"bs": [args.chunk]}},
            backend=_backend("breakable", "prefill", device, emulated),
            **common,
        ),
        "decode": DecodeCudaGraphRunner(
            model, {"decode": {"bs": [args.decodes]}}, backend=_backend("full", "decode", device, emulated), **common
        ),
    }
    with torch.no_grad():
        for runner in runners.values():
            runner.capture()
    # Running requests with cached prefixes (their K/V values do not matter for timing).
    running = make_extend_batch(cache, make_dummy_prompts(args.decodes, [args.prefix] * args.decodes, vocab, seed=1))
    rows = running.req_pool_indices.tolist()
    chunk = make_dummy_prompts(1, [args.chunk], vocab, seed=2)[0]
    next_tokens = [(7 * r) % vocab for r in rows]
    mixed = make_extend_batch(cache, [chunk, *[[t] for t in next_tokens]], rows=[cache.alloc_request(), *rows])
    prefill = make_extend_batch(cache, [chunk])
    decode = make_decode_batch(cache, rows, None, next_tokens)
    return {"model": model, "runners": runners, "mixed": mixed, "prefill": prefill, "decode": decode}


def steps(built: Dict[str, Any]) -> Dict[str, Callable[[], Any]]:
    """One step per method (each checked to replay, never to fall back to eager)."""
    r = built["runners"]
    mixed, prefill, decode = built["mixed"], built["prefill"], built["decode"]
    for name, runner, batch in (
        ("mixed_full", r["mixed_full"], mixed),
        ("mixed_breakable", r["mixed_breakable"], mixed),
        ("prefill", r["prefill"], prefill),
        ("decode", r["decode"], decode),
    ):
        if not runner.can_run(batch):
            raise SystemExit(f"{name}: the step does not replay a graph (run_stats: {runner.run_stats()})")

    def separate() -> Any:
        r["prefill"].forward(prefill)
        return r["decode"].forward(decode)

    return {
        "mixed_full": lambda: r["mixed_full"].forward(mixed),
        "mixed_breakable": lambda: r["mixed_breakable"].forward(mixed),
        "separate": separate,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    fns: Dict[str, Callable[[], Any]], device: torch.device, iters: int, repeats: int, warmup: int
) -> Dict[str, List[float]]:
    """Per method, the mean step time (ms) of each round; rounds alternate the methods."""
    with torch.no_grad():
        for fn in fns.values():
            for _ in range(warmup):
                fn()
        _sync(device)
        rounds: Dict[str, List[float]] = {name: [] for name in fns}
        for i in range(repeats):
            order = list(fns) if i % 2 == 0 else list(reversed(fns))
            for name in order:
                _sync(device)
                start = time.perf_counter()
                for _ in range(iters):
                    fns[name]()
                _sync(device)
                rounds[name].append((time.perf_counter() - start) * 1e3 / iters)
    return rounds


def ratio(num: List[float], den: List[float]) -> Dict[str, float]:
    per_round = [a / b for a, b in zip(num, den)]
    return {"median": statistics.median(per_round), "min": min(per_round), "max": max(per_round)}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-3.2-1b", help="reference model preset (default llama-3.2-1b)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--attention", default=None, help="default triton on CUDA, planned_standin on the CPU")
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk tokens (default 256)")
    parser.add_argument("--decodes", type=int, default=31, help="decodes beside the chunk (default 31)")
    parser.add_argument("--prefix", type=int, default=128, help="cached tokens of each decoding request")
    parser.add_argument("--iters", type=int, default=20, help="steps per round and method")
    parser.add_argument("--repeats", type=int, default=15, help="rounds")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per method first")
    parser.add_argument("--json", help="write the result to this file")
    args = parser.parse_args(argv)
    for name in ("chunk", "decodes", "prefix", "iters", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: must be >= 1")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu --preset tiny for a smoke run)")
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    built = build(args)
    rounds = measure(steps(built), device, args.iters, args.repeats, args.warmup)
    result = {
        "preset": args.preset,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "attention": built["model"].attn_backend.name,
        "step": {"chunk_tokens": args.chunk, "decodes": args.decodes, "prefix_tokens": args.prefix},
        "iters": args.iters,
        "repeats": args.repeats,
        "methods": {
            name: {"median_ms": statistics.median(v), "min_ms": min(v), "samples_ms": v} for name, v in rounds.items()
        },
        "ratios": {
            "mixed_full/separate": ratio(rounds["mixed_full"], rounds["separate"]),
            "mixed_breakable/separate": ratio(rounds["mixed_breakable"], rounds["separate"]),
        },
        "target": {"mixed_full/separate": TARGET},
    }
    full_ratio = result["ratios"]["mixed_full/separate"]["median"]
    result["target_met"] = full_ratio <= TARGET
    print(
        f"{args.preset} {args.dtype} on {result['device']} ({result['attention']}): one chunk of {args.chunk} "
        f"tokens + {args.decodes} decodes"
    )
    for name, row in result["methods"].items():
        print(f"  {name:<16} {row['median_ms']:9.3f} ms (min {row['min_ms']:.3f})")
    for name, r in result["ratios"].items():
        print(f"  {name:<26} {r['median']:.3f} (range {r['min']:.3f}-{r['max']:.3f})")
    print(f"  target mixed_full/separate <= {TARGET}: {'met' if result['target_met'] else 'missed'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
