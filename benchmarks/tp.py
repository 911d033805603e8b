#!/usr/bin/env python3
"""Tensor-parallel decode benchmark: TP=1 vs TP=N, eager and each graph backend.

One process per rank (``torchrun``); rank 0 prints and writes the JSON::

    python benchmarks/tp.py --json tp1.json                                  # TP=1
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/tp.py --json tp2.json   # TP=2

Per batch size (default 1, 8, 32, 128; ``llama-3.2-1b`` bfloat16, random weights):

* ``eager ms``: one decode step of the model run eagerly;
* per backend: ``forward ms`` (``runner.forward``: the ranks' replay-or-eager agreement,
  one host gloo all-reduce, plus the replay), ``replay ms`` (``runner.replay`` alone);
* capture seconds and graph memory (MiB, this rank's pool) per backend; for
  ``tc_piecewise:<compiler>`` also the Dynamo graphs compiled on the rank (``bs`` 1 is
  one more: 2 for the default sizes) and the compile pass's seconds;
* ``comm ms``: the step's collectives alone, captured in one CUDA graph and replayed:
  ``2 * layers + 1`` all-reduces of ``[bs, hidden]`` (o_proj, down_proj, embedding) and
  the gather of the ``[bs, vocab / N]`` float32 logits (0 at TP=1).

Every rank runs the same fixed number of steps (no time-based loop: ranks that stop at
different times would deadlock their collectives), and ends in bounded time
(``cuda_graph_runner.runner.distributed.shutdown`` + ``exit_now``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback
from typing import Any, Dict, List

import torch


def _comm_ms(tp: Any, model: Any, bs: int, iters: int) -> float:
    """Milliseconds per replay of a graph holding one decode step's collectives."""
    from cuda_graph_runner.backend.pool import graph_owned_cublas_workspace
    from cuda_graph_runner.cli.bench.command import time_ms
    from cuda_graph_runner.runner.distributed import all_gather_last_dim, all_reduce

    if tp is None or not tp.is_parallel:
        return 0.0
    cfg = model.config
    x = torch.zeros(bs, cfg.hidden_size, dtype=model.dtype, device=tp.device)
    logits = torch.zeros(bs, model.tp_layout.local_vocab, dtype=torch.float32, device=tp.device)

    def step() -> None:
        for _ in range(2 * cfg.num_hidden_layers + 1):
            all_reduce(x, tp)
        all_gather_last_dim(logits, tp)

    stream = torch.cuda.Stream(tp.device)
    stream.wait_stream(torch.cuda.current_stream(tp.device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream(tp.device).wait_stream(stream)
    tp.barrier()
    graph = torch.cuda.CUDAGraph()
    with graph_owned_cublas_workspace(torch.cuda.graph(graph, stream=stream), torch.cuda):
        step()
    tp.barrier()
    sync = lambda: torch.cuda.synchronize(tp.device)  # noqa: E731
    return time_ms(graph.replay, iters=iters, warmup=3, sync=sync)


def main() -> int:
    from cuda_graph_runner.config.integers import count_arg

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--batch-sizes", type=count_arg(1), nargs="+", default=[1, 8, 32, 128])
    parser.add_argument(
        "--backends",
        default="full,breakable,tc_piecewise:eager,tc_piecewise:inductor",
        help="comma-separated decode backends, each name[:tc_compiler] or full+torch_compile",
    )
    parser.add_argument("--prompt-len", type=count_arg(1), default=32)
    parser.add_argument("--iters", type=count_arg(1), default=20)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()

    from cuda_graph_runner.runner.distributed import exit_now, init_tensor_parallel, shutdown

    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp = init_tensor_parallel(world, device_type="cuda") if world > 1 else None
    code = 0
    try:
        run(args, tp)
    except BaseException:
        traceback.print_exc()
        code = 1
    if tp is not None:
        if not shutdown(30.0):
            print(f"rank {tp.rank}: process-group teardown passed 30 s; exiting anyway", file=sys.stderr)
        exit_now(code)  # no exit hook may hang a finished run
    return code


def run(args: argparse.Namespace, tp: Any) -> None:
    from cuda_graph_runner.cli.bench.command import load_model, time_ms
    from cuda_graph_runner.reference.batches import (
        GreedySession,
        eager_logits_fn,
        make_decode_batch,
        make_dummy_prompts,
    )
    from cuda_graph_runner.runner import DecodeCudaGraphRunner

    rank0 = tp is None or tp.rank == 0
    say = print if rank0 else (lambda *a, **k: None)
    device = tp.device if tp is not None else torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype)
    sizes = sorted(set(args.batch_sizes))
    size = tp.size if tp is not None else 1
    model = load_model(args.model, dtype=dtype, device=device, tp_group=tp)
    context = args.prompt_len + 8
    max_reqs = sum(sizes) + 1  # every size's session keeps its requests for the whole run
    cache = model.create_kv_cache(num_slots=max_reqs * context + 1, max_reqs=max_reqs, max_context_len=context)
    sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
    eager = eager_logits_fn(model)
    say(f"{args.model} {args.dtype}, TP={size}, {torch.cuda.get_device_name(device)}, torch {torch.__version__}")

    sessions: Dict[int, Any] = {}
    batches = {}
    with torch.no_grad():
        for bs in sizes:
            s = GreedySession(model, cache)
            s.prefill(make_dummy_prompts(bs, args.prompt_len, model.config.vocab_size, seed=bs))
            sessions[bs] = s
            batches[bs] = make_decode_batch(cache, s.rows, None, [t[-1] for t in s.tokens])
            # One KV slot per step is enough: the timed step rewrites the same slots.
    results: Dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "tp": size,
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "rows": [],
        "runners": {},
    }
    with torch.no_grad():
        for bs in sizes:
            row = {
                "batch_size": bs,
                "eager_ms": time_ms(lambda: eager(batches[bs]), iters=args.iters, warmup=3, sync=sync),
            }
            row["comm_ms"] = _comm_ms(tp, model, bs, args.iters)
            results["rows"].append(row)
        from cuda_graph_runner.cli.bench.backends import label_options, parse_label

        for backend in [b for b in args.backends.split(",") if b]:
            name, compiler = parse_label(backend)  # full+torch_compile; full:inductor warns
            phase = {
                "backend": name,
                "bs": sizes,
                "max_bs": max(sizes),
                **label_options(compiler, max(sizes), None),
            }
            runner = DecodeCudaGraphRunner(model, {"decode": phase}, show_progress=False)
            report = runner.capture()
            mem = runner.capture_memory_bytes
            results["runners"][backend] = {
                "capture_s": report.seconds,
                "graph_memory_mib": None if mem is None else mem / 2**20,
            }
            compiles = getattr(runner.backend, "dynamo_compiles", None)
            if compiles is not None:  # tc_piecewise: Dynamo graphs on this rank (no recompile per size)
                results["runners"][backend]["dynamo_compiles"] = compiles
                results["runners"][backend]["compile_s"] = runner.backend.compile_seconds
            for row in results["rows"]:
                batch = batches[row["batch_size"]]
                assert runner.can_run(batch), (backend, row["batch_size"])
                row[f"{backend}_forward_ms"] = time_ms(
                    lambda: runner.forward(batch), iters=args.iters, warmup=3, sync=sync
                )
                row[f"{backend}_replay_ms"] = time_ms(
                    lambda: runner.replay(batch), iters=args.iters, warmup=3, sync=sync
                )
                diff = (runner.forward(batch).float() - eager(batch).float()).abs().max().item()
                row[f"{backend}_max_abs_diff"] = diff
            runner.cleanup()
            torch.cuda.empty_cache()
    for s in sessions.values():
        s.close()

    backends = list(results["runners"])
    head = ["batch", "eager ms", "comm ms"] + [f"{b} {k}" for b in backends for k in ("fwd ms", "replay ms")]
    say("  ".join(f"{h:>16}" for h in head))
    for row in results["rows"]:
        cells: List[Any] = [row["batch_size"], row["eager_ms"], row["comm_ms"]]
        cells += [row[f"{b}_{k}"] for b in backends for k in ("forward_ms", "replay_ms")]
        say("  ".join(f"{c:>16.3f}" if isinstance(c, float) else f"{c:>16}" for c in cells))
    for b, r in results["runners"].items():
        mem = r["graph_memory_mib"]
        extra = f", {r['dynamo_compiles']} Dynamo graph(s) per rank" if "dynamo_compiles" in r else ""
        say(
            f"{b}: capture {r['capture_s']:.2f} s, graph memory {'-' if mem is None else f'{mem:.1f}'} MiB per rank"
            + extra
        )
    if args.json_path and rank0:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=2)
        say(f"wrote {args.json_path}")


if __name__ == "__main__":
    sys.exit(main())
