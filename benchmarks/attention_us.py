#!/usr/bin/env python3
"""Attention µs per layer per call at batch 1: each attention backend of the reference
model on a model preset's head layout (bfloat16), one decode request of each context.

For each (backend, context) the ``layers`` attention calls of one decode step (a K/V
cache per layer, as the model has) are

* recorded in one CUDA graph and replayed (``graph_us``: the device time per call, what a
  captured decode step pays), and
* run eagerly (``eager_us``: device plus host launch time per call);

``plan_us`` is the host time of one replay hook per step (0 for an attention that plans
nothing; FlashInfer's re-plan for ``flashinfer``, ``flashinfer_tc``), which a graph replay of
a plan-based attention also runs before each replay in ``graph_us``.

Ratios in one run; nothing asserted. Usage (device machine)::

    python benchmarks/attention_us.py --attention torch triton flashinfer --contexts 512 4096 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional

import torch

from cuda_graph_runner.backend.context import forward_context
from cuda_graph_runner.backend.forward_batch import ForwardBatch, ForwardMode, as_static_batch
from cuda_graph_runner.reference.model import PRESETS
from cuda_graph_runner.reference.model.attention_backend import attention_backend_names, make_attention_backend


def time_attention(name: str, preset: str, context: int, replays: int) -> Dict[str, float]:
    """``{"graph_us", "eager_us"}`` per layer per call of attention ``name``, and ``plan_us``
    of host time per step."""
    c = PRESETS[preset]
    layers, kv_heads, d, heads = c.num_hidden_layers, c.num_key_value_heads, c.head_dim, c.num_attention_heads
    backend = make_attention_backend(name)
    dev, dtype = "cuda", torch.bfloat16
    slots = context + 1
    ks = [torch.randn(slots, kv_heads, d, device=dev, dtype=dtype) for _ in range(layers)]
    vs = [torch.randn(slots, kv_heads, d, device=dev, dtype=dtype) for _ in range(layers)]
    r2t = torch.zeros(2, context, dtype=torch.int64, device=dev)
    r2t[1] = torch.arange(1, context + 1, device=dev)
    one = torch.zeros(1, dtype=torch.int64, device=dev)
    batch = ForwardBatch(
        forward_mode=ForwardMode.DECODE, input_ids=one, positions=one + context - 1, out_cache_loc=one + context,
        req_pool_indices=one + 1, seq_lens=torch.tensor([context], dtype=torch.int32, device=dev),
        seq_lens_cpu=[context],
    )  # fmt: skip
    q = torch.randn(1, heads * d, device=dev, dtype=dtype)
    out = torch.empty_like(q)

    def step() -> None:
        for i in range(layers):
            backend.forward(out, q, ks[i], vs[i], r2t, d**-0.5, c.sliding_window or 0, i == layers - 1)

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    # A plan-based attention (flashinfer) runs as the runner drives it: its graph on a static
    # batch planned by the capture hook and re-planned by the replay hook before every replay,
    # its eager steps each planned by the eager hook. Others plan nothing: these are no-ops.
    plans = backend.plans
    static = as_static_batch(batch) if plans else batch
    replan = (lambda: backend.init_forward_metadata_replay_cuda_graph(static)) if plans else (lambda: None)
    eager_plan = (lambda: backend.init_forward_metadata(batch)) if plans else (lambda: None)
    with torch.no_grad():
        with forward_context(static):
            if plans:
                backend.init_forward_metadata_capture_cuda_graph(static)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            replan()
            graph.replay()
            torch.cuda.synchronize()
            start.record()
            for _ in range(replays):
                replan()
                graph.replay()
            end.record()
            end.synchronize()
            graph_us = start.elapsed_time(end) * 1e3 / (replays * layers)
            host = time.perf_counter()
            for _ in range(replays):
                replan()
            plan_us = (time.perf_counter() - host) * 1e6 / replays
            torch.cuda.synchronize()
        with forward_context(batch):
            start.record()
            for _ in range(replays):
                eager_plan()
                step()
            end.record()
            end.synchronize()
            eager_us = start.elapsed_time(end) * 1e3 / (replays * layers)
    return {"graph_us": graph_us, "eager_us": eager_us, "plan_us": plan_us}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attention", nargs="+", default=["torch", "triton"], choices=attention_backend_names())
    parser.add_argument("--contexts", nargs="+", type=int, default=[512, 4096])
    parser.add_argument("--model", default="llama-3.2-1b", choices=sorted(PRESETS))
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--out", default=None, help="folder for attention_us.json (default: print only)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_us.py needs a CUDA device", file=sys.stderr)
        return 2
    results: Dict[str, Any] = {"model": args.model, "device": torch.cuda.get_device_name(), "rows": []}
    print(f"{args.model} attention, batch 1, µs per layer per call (graph replay | eager), plan µs per step")
    for context in args.contexts:
        for name in args.attention:
            try:
                row = time_attention(name, args.model, context, args.replays)
            except Exception as exc:  # one backend failing must not hide the others
                print(f"  {name:>16} context {context:>5}: failed: {type(exc).__name__}: {exc}", flush=True)
                continue
            results["rows"].append({"attention": name, "context": context, **row})
            print(
                f"  {name:>16} context {context:>5}: {row['graph_us']:8.2f} | {row['eager_us']:8.2f}, "
                f"plan {row['plan_us']:7.1f}",
                flush=True,
            )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "attention_us.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
