"""Probe (dev tool): where a compiled-full decode step's device time goes.

Profiles the compiled forward (static sizes, run without the graph) kernel by kernel,
times the captured replay, and times the reference attention op's decode body
eager against the same body compiled with inductor (both recorded in a CUDA graph of
one call per layer). The H200 numbers that made compiled full compile the marked ops'
bodies: ``benchmarks/results/2026-12-01-h200-compiled-full/attention_probe.txt``.

    python3 benchmarks/probe_step_kernels.py --model llama-3.2-1b --batch-sizes 1 32
    python3 benchmarks/probe_step_kernels.py --batch-sizes 1 --attention triton --no-attention-probe

``--attention`` picks the model's attention backend for the step table (default torch);
``--no-attention-probe`` skips the torch-attention body probe.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import probe_compiled_full  # noqa: E402
import run  # noqa: E402

from cuda_graph_runner.backend.context import forward_context  # noqa: E402
from cuda_graph_runner.config.integers import count_arg  # noqa: E402
from cuda_graph_runner.reference.model.attention import _decode_metadata  # noqa: E402
from cuda_graph_runner.registry import get_registry  # noqa: E402
from cuda_graph_runner.runner import DecodeCudaGraphRunner  # noqa: E402


def kernel_table(fn, steps: int = 5):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    count = collections.Counter()
    us = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            count[e.name] += 1
            us[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    rows = sorted(us, key=lambda n: -us[n])
    return {
        "kernels_per_step": sum(count.values()) / steps,
        "device_us_per_step": round(sum(us.values()) / steps, 1),
        "top": [(n[:90], count[n] / steps, round(us[n] / steps, 1)) for n in rows[:40]],
    }


def timed(fn, iters: int = 200, rounds: int = 5) -> float:
    best = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        best.append((time.perf_counter() - t0) * 1e6 / iters)
    best.sort()
    return round(best[len(best) // 2], 2)


def graphed(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def core(out, q, k_cache, v_cache, slots, mask, scaling: float):
    bs = slots.shape[0]
    _, kv_heads, d = k_cache.shape
    heads = q.shape[1] // d
    group = heads // kv_heads
    k = k_cache[slots].transpose(1, 2)
    v = v_cache[slots].transpose(1, 2)
    qg = q.view(bs, 1, heads, d).transpose(1, 2).reshape(bs, kv_heads, group, d)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scaling)
    out.copy_(o.reshape(bs, heads, 1, d).transpose(1, 2).reshape(bs, heads * d))


def attention_probe(model, batch, result):
    cache = model.kv_cache
    cfg = model.config
    d = cfg.head_dim
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    bs = batch.req_pool_indices.shape[0]
    layers = cfg.num_hidden_layers
    q = torch.randn(bs, heads * d, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    with forward_context(batch):
        slots, mask = _decode_metadata(batch, cache.req_to_token, heads // kv_heads, 0, release=False)
    bias = torch.zeros(mask.shape, dtype=torch.bfloat16, device="cuda").masked_fill_(~mask, float("-inf"))
    scaling = d**-0.5
    compiled = torch.compile(core, dynamic=False, options={"triton.cudagraphs": False})

    def run_all(f, m):
        def step():
            for i in range(layers):
                f(out, q, cache.k_buffers[i], cache.v_buffers[i], slots, m, scaling)

        return step

    variants = {
        "eager_boolmask": run_all(core, mask),
        "eager_biasmask": run_all(core, bias),
        "compiled_boolmask": run_all(compiled, mask),
        "compiled_biasmask": run_all(compiled, bias),
    }
    res = {}
    for name, fn in variants.items():
        try:
            table = kernel_table(fn, steps=2)
            res[name] = {
                "graph_us_per_step": timed(graphed(fn)),
                "kernels_per_step": table["kernels_per_step"],
                "top": table["top"][:8],
            }
        except Exception as exc:  # a probe: report and go on
            res[name] = repr(exc)[:400]
        print(f"attention bs {bs} {name}: {json.dumps(res[name])[:600]}", flush=True)
    result[f"attention_bs{bs}"] = res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--batch-sizes", type=count_arg(1), nargs="+", default=[1, 32])
    p.add_argument("--out", default=None)
    p.add_argument("--attention", default="torch", help="the model's attention backend (default torch)")
    p.add_argument("--no-attention-probe", dest="attention_probe", action="store_false")
    a = p.parse_args()
    model, bs_list, batches = probe_compiled_full.setup(a.model, a.batch_sizes, a.attention)
    result = {}
    with torch.no_grad():
        for bs in bs_list if a.attention_probe else ():
            attention_probe(model, batches[bs], result)
        cfg = {"backend": "full", "tc_compiler": "inductor", "bs": bs_list, "compile_sizes": bs_list}
        backend = get_registry().resolve("decode", cfg, device="cuda", memory_pool=torch.cuda.graph_pool_handle())
        runner = DecodeCudaGraphRunner(model, {"decode": cfg}, show_progress=False, backend=backend)
        runner.capture()
        compiled = backend.compiled_forward
        eager = run.eager_fn(model)
        for bs in bs_list:
            b = batches[bs]

            def step(b=b, bs=bs):
                # model.forward (the instance attribute active() installs), not run.py's
                # eager path, which calls the class's forward
                with compiled.active(bs), forward_context(b):
                    return model.compute_logits(model.forward(b), b)

            table = kernel_table(step)
            table["replay_us"] = timed(lambda b=b: runner.forward(b))
            table["eager_us"] = timed(lambda b=b: eager(b), iters=20)
            result[f"step_bs{bs}"] = table
            print(f"step bs {bs}: " + json.dumps(table, indent=0)[:6000], flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
