"""Probe (dev tool): compiled full's inductor options and compile sizes against
torch.compile reduce-overhead, interleaved in one process. Prints ms per decode step
(median of rounds) and each variant's ratio to reduce-overhead.

    python3 benchmarks/probe_compiled_full.py --model llama-3.2-1b --batch-sizes 1 32 128

Inductor is pinned as in ``run.py`` (timing-free kernel choices); a variant's options
override that. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any, Dict
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402

from cuda_graph_runner.config.integers import count_arg  # noqa: E402
from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM  # noqa: E402
from cuda_graph_runner.registry import get_registry  # noqa: E402
from cuda_graph_runner.runner import DecodeCudaGraphRunner  # noqa: E402

#: name -> (compile sizes: None for one dynamic graph, "sizes" for the batch sizes;
#: inductor options passed to compiled full, on top of ``triton.cudagraphs=False``).
VARIANTS = {
    "dyn_cdt": (None, {"coordinate_descent_tuning": True}),
    "dyn": (None, {}),
    "static": ("sizes", {}),
    "static_eager_ops": ("sizes", {}),  # the marked ops' bodies as written (not compiled)
    "static_mag": ("sizes", {"max_autotune_gemm": True}),
    "static_mag_aggr": ("sizes", {"max_autotune_gemm": True, "aggressive_fusion": True}),
    "dyn_mag": (None, {"max_autotune_gemm": True}),
}


def setup(name: str, batch_sizes, attention: str = "torch"):
    """Inductor pinned, the preset on CUDA in bf16 with ``attention`` and a KV cache of 48
    positions, and one live decode batch per size (32-token prompts prefilled):
    ``(model, sizes, batches)``."""
    run.pin_inductor("pinned")
    model = ReferenceLlamaForCausalLM.from_preset(name, dtype=torch.bfloat16, device="cuda", attention=attention)
    bs_list = sorted(batch_sizes)
    context = 48
    max_reqs = sum(bs_list) + 2
    model.create_kv_cache(num_slots=max_reqs * context + 1, max_reqs=max_reqs, max_context_len=context)
    return model, bs_list, run.decode_batches(model, bs_list, 32)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--batch-sizes", type=count_arg(1), nargs="+", default=[1, 32, 128])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--rounds", type=count_arg(1), default=7)
    p.add_argument("--iters", type=count_arg(1), default=100)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    model, bs_list, batches = setup(a.model, a.batch_sizes)
    methods = {bs: {} for bs in bs_list}
    compile_s = {}
    keep = []
    for name in a.variants:
        sizes, options = VARIANTS[name]
        torch._dynamo.reset()
        cfg = {"backend": "full", "torch_compile": True, "torch_compile_max_bs": max(bs_list), "bs": bs_list}
        if sizes:
            cfg["compile_sizes"] = bs_list
        backend = get_registry().resolve(
            "decode", cfg, device="cuda", memory_pool=torch.cuda.graph_pool_handle(), inductor_options=options
        )
        runner = DecodeCudaGraphRunner(model, {"decode": cfg}, show_progress=False, backend=backend)
        start = time.perf_counter()
        with contextlib.ExitStack() as stack:
            if name == "static_eager_ops":
                import cuda_graph_runner_full.compiled as compiled_module

                stack.enter_context(mock.patch.object(compiled_module, "registered_eager_ops", dict))
            runner.capture()
        compile_s[name] = round(time.perf_counter() - start, 1)
        keep.append(runner)
        for bs in bs_list:
            methods[bs][name] = lambda r=runner, b=batches[bs]: r.forward(b)
        graphs = (backend.compiled_forward.dynamo_graphs, backend.compiled_forward.op_body_graphs)
        print(f"{name}: compiled+captured in {compile_s[name]} s, graphs (forward, op bodies) {graphs}", flush=True)
    for bs in bs_list:
        start = time.perf_counter()
        fn = run.reduce_overhead_fn(model, batches[bs])
        with torch.no_grad():
            for _ in range(3):
                fn(batches[bs])
        methods[bs]["ro"] = lambda fn=fn, b=batches[bs]: fn(b)
        print(f"ro bs {bs}: {time.perf_counter() - start:.1f} s", flush=True)
    result: Dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "compile_s": compile_s,
    }
    with torch.no_grad():
        for bs in bs_list:
            times = {m: [] for m in methods[bs]}
            for r in range(a.rounds + 1):
                for m, fn in methods[bs].items():
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(a.iters):
                        fn()
                    torch.cuda.synchronize()
                    if r:
                        times[m].append((time.perf_counter() - t0) * 1e3 / a.iters)
            med = {m: statistics.median(v) for m, v in times.items()}
            ratios = {m: round(med[m] / med["ro"], 3) for m in med}
            result[bs] = {"ms": {m: round(v, 4) for m, v in med.items()}, "ratio_to_ro": ratios}
            print(f"bs {bs}: " + ", ".join(f"{m} {med[m]:.3f} ms ({ratios[m]}x)" for m in med), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
