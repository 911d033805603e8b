#!/usr/bin/env python3
"""What graph variants cost and save: the LoRA and no-LoRA graphs of one decode runner.

The reference model gets ``--adapters`` random LoRA adapters of rank ``--rank`` on every
attention and MLP projection (:mod:`cuda_graph_runner.reference.model.lora`); one decode
runner captures the variants ``nolora`` and ``lora`` for every size up to the largest
``--batch-sizes`` entry (:mod:`cuda_graph_runner.runner.variants`). Rows:

* **ms per step** at each batch size: a batch in which no request uses an adapter
  (replays ``nolora``), one mixing requests without an adapter and with different
  adapters (replays ``lora``), and, for scale, the mixed batch run eagerly. Timed in
  interleaved rounds (``bench_rounds.run_rounds``: warm-up to steady state, median and
  range of the rounds).
* **capture cost of the variants**: capture seconds and graph-pool bytes of a runner
  capturing only ``nolora`` against one capturing both (each in its own pool, after one
  untimed capture that warms kernels and allocator up); the difference is what the
  ``lora`` variant costs.

Usage (on the device machine)::

    python benchmarks/variants.py --json $OUT/variants.json
    python benchmarks/variants.py --model qwen2.5-0.5b --backend breakable --batch-sizes 1 32

Exit status: 0 done, 2 no CUDA device (or the backend is not installed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rounds import run_rounds  # noqa: E402

DTYPES = ("bfloat16", "float16", "float32")


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    from cuda_graph_runner.config.integers import count_arg

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.2-1b", help="a reference-model preset (default llama-3.2-1b)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--backend", default="full", help="decode backend (default full)")
    parser.add_argument(
        "--batch-sizes", type=count_arg(1), nargs="+", default=[1, 32], help="timed batch sizes (default 1 32)"
    )
    parser.add_argument("--adapters", type=count_arg(1), default=4, help="LoRA adapters (default 4)")
    parser.add_argument("--rank", type=count_arg(1), default=16, help="LoRA rank (default 16)")
    parser.add_argument("--prompt-len", type=count_arg(1), default=64, help="cached tokens per request (default 64)")
    parser.add_argument("--iters", type=count_arg(1), default=20, help="steps per timed block (default 20)")
    parser.add_argument("--rounds", type=count_arg(1), default=10, help="measured rounds (default 10)")
    parser.add_argument("--warmup-max", type=count_arg(1), default=20, help="most warm-up rounds (default 20)")
    parser.add_argument("--json", dest="json_path", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if min(args.batch_sizes) < 1 or args.adapters < 1 or args.rank < 1:
        parser.error("--batch-sizes, --adapters and --rank take integers >= 1")
    return args


def build(args: argparse.Namespace) -> Any:
    import torch

    from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM

    model = ReferenceLlamaForCausalLM.from_preset(args.model, dtype=getattr(torch, args.dtype), device="cuda")
    model.add_lora_adapters(args.adapters, args.rank, alpha=2.0 * args.rank)
    max_bs = max(args.batch_sizes)
    context = args.prompt_len + 8
    model.create_kv_cache(num_slots=(max_bs + 1) * context + 1, max_reqs=max_bs + 1, max_context_len=context)
    return model


def make_runner(model: Any, backend: str, max_bs: int, variants: List[str]) -> Any:
    import torch

    from cuda_graph_runner.registry import resolve_decode_backend
    from cuda_graph_runner.runner import DecodeCudaGraphRunner

    cfg = {"backend": backend, "max_bs": max_bs, "variants": variants}
    # Its own pool: the pool bytes are this runner's graphs only.
    resolved = resolve_decode_backend(cfg, device="cuda", memory_pool=torch.cuda.graph_pool_handle())
    return DecodeCudaGraphRunner(model, {"decode": cfg}, backend=resolved, show_progress=False)


def capture_cost(model: Any, backend: str, max_bs: int) -> Dict[str, Any]:
    """Capture seconds and pool bytes with ``nolora`` only and with both variants."""
    warm = make_runner(model, backend, max_bs, ["nolora", "lora"])
    warm.capture()  # untimed: first-use kernels, cuBLAS workspaces, allocator growth
    warm.cleanup()
    out: Dict[str, Any] = {}
    for label, variants in (("nolora", ["nolora"]), ("nolora+lora", ["nolora", "lora"])):
        runner = make_runner(model, backend, max_bs, variants)
        report = runner.capture()
        out[label] = {
            "graphs": len(runner.captured_keys),
            "sizes": runner.capture_sizes,
            "capture_s": report.seconds,
            "pool_bytes": runner.capture_memory_bytes,
        }
        runner.cleanup()
        del runner
    a, b = out["nolora"], out["nolora+lora"]
    out["extra_capture_s"] = b["capture_s"] - a["capture_s"]
    out["extra_pool_bytes"] = (
        b["pool_bytes"] - a["pool_bytes"] if None not in (a["pool_bytes"], b["pool_bytes"]) else None
    )
    return out


def step_times(model: Any, runner: Any, args: argparse.Namespace) -> Dict[str, Any]:
    """ms per step of the nolora graph, the lora graph and the eager lora step, per batch size."""
    import torch

    from cuda_graph_runner.reference.batches import (
        eager_logits_fn,
        make_decode_batch,
        make_dummy_prompts,
        make_extend_batch,
    )
    from cuda_graph_runner.reference.model import LORA_IDS

    cache = model.kv_cache
    eager = eager_logits_fn(model)
    results: Dict[str, Any] = {}
    for bs in args.batch_sizes:
        prompts = make_dummy_prompts(bs, args.prompt_len, model.config.vocab_size, seed=bs)
        with torch.no_grad():
            prefill = make_extend_batch(cache, prompts)
            eager(prefill)
        rows = prefill.req_pool_indices.tolist()
        plain = make_decode_batch(cache, rows, None, [1] * bs)
        plain.extra[LORA_IDS] = [-1] * bs
        mixed = plain.replace(extra={LORA_IDS: [(i % (args.adapters + 1)) - 1 for i in range(bs)]})
        if bs == 1:
            mixed.extra[LORA_IDS] = [0]
        keys = {
            name: runner.key_for_batch(b, runner.padded_size(bs)).variant
            for name, b in (("nolora", plain), ("lora", mixed))
        }
        cells = run_rounds(
            {
                "nolora graph": lambda: runner.forward(plain),
                "lora graph": lambda: runner.forward(mixed),
                "lora eager": lambda: eager(mixed),
            },
            iters=args.iters,
            rounds=args.rounds,
            sync=torch.cuda.synchronize,
            warmup_min=min(3, args.warmup_max),  # --warmup-max below the default minimum lowers it
            warmup_max=args.warmup_max,
        )
        row = {name: cell.summary() for name, cell in cells.items()}
        row["keys"] = keys
        nl, lo = row["nolora graph"]["median_ms"], row["lora graph"]["median_ms"]
        row["lora_over_nolora"] = lo / nl if nl else None
        results[str(bs)] = row
        for r in rows:
            cache.free_request(r)
    return results


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("benchmarks/variants.py needs a CUDA device", file=sys.stderr)
        return 2
    from cuda_graph_runner.backend.errors import UnknownBackendError

    model = build(args)
    max_bs = max(args.batch_sizes)
    try:
        capture = capture_cost(model, args.backend, max_bs)
    except UnknownBackendError as err:
        print(err, file=sys.stderr)
        return 2
    runner = make_runner(model, args.backend, max_bs, ["nolora", "lora"])
    runner.capture()
    with torch.no_grad():
        steps = step_times(model, runner, args)
    runner.cleanup()
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "backend": args.backend,
        "adapters": args.adapters,
        "rank": args.rank,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "capture": capture,
        "step_ms": steps,
    }
    print(f"{args.model} {args.dtype}, backend {args.backend}, {args.adapters} adapters of rank {args.rank}")
    for bs, row in steps.items():
        cells = "  ".join(f"{n} {row[n]['median_ms']:.3f} ms" for n in ("nolora graph", "lora graph", "lora eager"))
        print(f"  bs {bs:>4}: {cells}  (lora/nolora {row['lora_over_nolora']:.2f}x)")
    for label in ("nolora", "nolora+lora"):
        c = capture[label]
        mib = f"{c['pool_bytes'] / 2**20:.1f} MiB" if c["pool_bytes"] is not None else "n/a"
        print(f"  capture {label:<12} {c['graphs']:>3} graphs  {c['capture_s']:.2f} s  pool {mib}")
    extra = capture["extra_pool_bytes"]
    print(
        f"  the lora variant costs {capture['extra_capture_s']:.2f} s of capture and "
        + (f"{extra / 2**20:.1f} MiB of pool" if extra is not None else "an unknown pool size")
    )
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
