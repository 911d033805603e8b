#!/usr/bin/env python3
"""Side-by-side benchmarks on one GPU, in one run: what a user picking a graph runner needs.

For each model preset (bfloat16, random weights; shapes of Llama-3.2-1B and Qwen2.5-0.5B):

* decode step latency (ms) per batch size for: eager; a hand-written single
  ``torch.cuda.CUDAGraph`` per batch size (copy the live inputs into its static tensors,
  replay: the floor for any runner's overhead); ``torch.compile(mode="reduce-overhead")``
  (CUDA-graph trees; at a few batch sizes, compile time is long); and every installed
  graph backend through ``DecodeCudaGraphRunner``;
* capture seconds and graph memory for the default decode size list (up to 256), and
  the memory of the largest size alone (the pool-sharing ratio);
* host-side time of ``replay_prepare`` (µs, median);
* prefill latency (ms) over token counts, eager vs each prefill-capable backend.

Times: median of ``--repeats`` measurements, each the mean of ``--iters`` calls between
two device synchronizes (METHOD.md: warm up, repeat, take the median). Results go to
``OUT/benchmarks.json`` (rewritten after every section, so a cut-short run keeps what it
measured) and ``OUT/benchmarks.md``.

Usage (device machine, after ``scripts/gpu_check.sh`` installed the packages)::

    python benchmarks/run.py --out $OUT
    python benchmarks/run.py --out /tmp/b --models llama-3.2-1b --batch-sizes 1 32 --quick
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from cuda_graph_runner.bench import time_ms
from cuda_graph_runner.errors import CudaGraphRunnerError
from cuda_graph_runner.forward_batch import ForwardBatch
from cuda_graph_runner.forward_context import forward_context
from cuda_graph_runner.registry import get_registry
from cuda_graph_runner.runner import DecodeCudaGraphRunner
from cuda_graph_runner.testing.batches import GreedySession, make_decode_batch, make_dummy_prompts, make_extend_batch
from cuda_graph_runner.testing.model import ReferenceLlamaForCausalLM

DECODE_BS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PREFILL_TOKENS = [128, 512, 2048]


def sync() -> None:
    torch.cuda.synchronize()


def bench_ms(fn: Callable[[], Any], *, iters: int, repeats: int, warmup: int = 3) -> float:
    """Median over ``repeats`` of the mean time (ms) of ``iters`` calls (the CLI bench's timer)."""
    return time_ms(fn, iters=iters, warmup=warmup, sync=sync, repeats=repeats)


class HandWrittenGraph:
    """One ``torch.cuda.CUDAGraph`` for exactly one batch size, no runner in between.

    Its ``__call__`` copies the live batch's five inputs into its static tensors and
    replays: the least any integration can do per step.
    """

    FIELDS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens")

    def __init__(self, model: Any, batch: ForwardBatch, pool: Any) -> None:
        self.static = batch.replace(**{f: getattr(batch, f).clone() for f in self.FIELDS})
        self.model = model
        stream = torch.cuda.Stream()
        fn = lambda: model.compute_logits(model.forward(self.static), self.static)  # noqa: E731
        with forward_context(self.static):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(stream)
            sync()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool, stream=stream):
                self.out = fn()

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        for f in self.FIELDS:
            getattr(self.static, f).copy_(getattr(batch, f), non_blocking=True)
        self.graph.replay()
        return self.out


def reduce_overhead_fn(model: Any, batch: ForwardBatch) -> Callable[[ForwardBatch], torch.Tensor]:
    """``torch.compile(mode="reduce-overhead")`` over the model for one batch size.

    The marked attention op reads metadata through the forward context, which Dynamo
    does not see, so the compiled function always runs on the same static tensors
    (live values copied in) to keep the addresses the captured graph reads.
    """
    static = batch.replace(**{f: getattr(batch, f).clone() for f in HandWrittenGraph.FIELDS})
    # CUDA-graph trees skip graphs that mutate non-static inputs; the KV cache and the
    # static inputs keep their addresses, so say so (as an engine integrating it would).
    cache = model.kv_cache
    for t in [*cache.k_buffers, *cache.v_buffers, cache.req_to_token,
              *(getattr(static, f) for f in HandWrittenGraph.FIELDS)]:
        torch._dynamo.mark_static_address(t)

    def step(b: ForwardBatch) -> torch.Tensor:
        return model.compute_logits(model.forward(b), b)

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=False)

    def call(live: ForwardBatch) -> torch.Tensor:
        for f in HandWrittenGraph.FIELDS:
            getattr(static, f).copy_(getattr(live, f), non_blocking=True)
        with forward_context(static):
            return compiled(static)

    return call


def eager_fn(model: Any) -> Callable[[ForwardBatch], torch.Tensor]:
    def call(b: ForwardBatch) -> torch.Tensor:
        with forward_context(b):
            return model.compute_logits(model.forward(b), b)

    return call


def available(phase: str, names: Sequence[str]) -> Dict[str, str]:
    """``{name: ""}`` for usable backends, ``{name: reason}`` for the others."""
    out = {}
    reg = get_registry()
    for name in names:
        try:
            reg.get(phase_options(name)["backend"], device_type="cuda", phase=phase)
            out[name] = ""
        except CudaGraphRunnerError as exc:
            out[name] = str(exc)
    return out


def phase_options(label: str) -> Dict[str, Any]:
    """``"tc_piecewise:inductor"`` -> ``{"backend": "tc_piecewise", "tc_compiler": "inductor"}``."""
    name, _, compiler = label.partition(":")
    return {"backend": name, **({"tc_compiler": compiler} if compiler else {})}


def fresh_backend(phase: str, label: str) -> Any:
    """Backend ``label`` (see :func:`phase_options`) capturing into a pool of its own."""
    return get_registry().resolve(phase, phase_options(label), device="cuda", memory_pool=torch.cuda.graph_pool_handle())


class Results:
    def __init__(self, out_dir: str, env: Dict[str, Any]) -> None:
        self.path = os.path.join(out_dir, "benchmarks.json")
        self.md_path = os.path.join(out_dir, "benchmarks.md")
        self.data: Dict[str, Any] = {"env": env, "models": {}, "notes": []}

    def model(self, name: str) -> Dict[str, Any]:
        return self.data["models"].setdefault(name, {"decode": {}, "prefill": {}, "capture": {}, "replay_prepare_us": {}})

    def note(self, text: str) -> None:
        print(f"note: {text}", flush=True)
        self.data["notes"].append(text)

    def save(self) -> None:
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=2)
        with open(self.md_path, "w") as f:
            f.write(to_markdown(self.data))


def _cell(v: Any, spec: str = ".3f") -> str:
    if v is None:
        return "-"
    return format(v, spec) if isinstance(v, float) else str(v)


def to_markdown(data: Dict[str, Any]) -> str:
    env = data["env"]
    lines = [f"GPU {env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, {env['date']}, bfloat16, random weights.", ""]
    for model, m in data["models"].items():
        methods = sorted({k for row in m["decode"].values() for k in row})
        order = [k for k in ("eager", "hand_graph", "reduce_overhead") if k in methods] + [k for k in methods if k not in ("eager", "hand_graph", "reduce_overhead")]
        lines += [f"### {model}: decode step (ms)", "", "| batch | " + " | ".join(order) + " |",
                  "|---|" + "---|" * len(order)]
        for bs in sorted(m["decode"], key=int):
            row = m["decode"][bs]
            lines.append(f"| {bs} | " + " | ".join(_cell(row.get(k)) for k in order) + " |")
        if m["capture"]:
            lines += ["", "| backend | sizes | capture s | graph memory MB | largest size alone MB | ratio | replay_prepare µs |",
                      "|---|---|---|---|---|---|---|"]
            for name, c in m["capture"].items():
                lines.append(f"| {name} | {c.get('sizes')} | {_cell(c.get('capture_s'), '.2f')} | {_cell(c.get('pool_mb'), '.1f')} | "
                             f"{_cell(c.get('largest_alone_mb'), '.1f')} | {_cell(c.get('pool_ratio'), '.2f')} | "
                             f"{_cell(m['replay_prepare_us'].get(name), '.1f')} |")
        if m["prefill"]:
            methods = sorted({k for row in m["prefill"].values() for k in row})
            lines += ["", f"### {model}: prefill (ms, 4 requests per batch)", "",
                      "| tokens | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
            for t in sorted(m["prefill"], key=int):
                lines.append(f"| {t} | " + " | ".join(_cell(m["prefill"][t].get(k)) for k in methods) + " |")
        lines.append("")
    if data["notes"]:
        lines += ["Notes:", ""] + [f"- {n}" for n in data["notes"]]
    return "\n".join(lines) + "\n"


def decode_batches(model: Any, batch_sizes: Sequence[int], prompt_len: int) -> Dict[int, ForwardBatch]:
    """One live decode batch per size, prompts prefilled eagerly (their KV in the cache)."""
    batches = {}
    for bs in batch_sizes:
        session = GreedySession(model, model.kv_cache)
        with torch.no_grad():
            session.prefill(make_dummy_prompts(bs, prompt_len, model.config.vocab_size, seed=bs))
        batches[bs] = make_decode_batch(model.kv_cache, session.rows, None, [t[-1] for t in session.tokens])
    return batches


def run_model(name: str, args: argparse.Namespace, results: Results) -> None:
    m = results.model(name)
    model = ReferenceLlamaForCausalLM.from_preset(name, dtype=torch.bfloat16, device="cuda")
    bs_list = sorted(args.batch_sizes)
    context = args.prompt_len + 16
    max_reqs = sum(bs_list) + 2
    model.create_kv_cache(num_slots=max_reqs * context + 1, max_reqs=max_reqs, max_context_len=context)
    batches = decode_batches(model, bs_list, args.prompt_len)
    kw = dict(iters=args.iters, repeats=args.repeats)
    pool = torch.cuda.graph_pool_handle()
    eager = eager_fn(model)

    with torch.no_grad():
        for bs in bs_list:
            row = m["decode"].setdefault(str(bs), {})
            b = batches[bs]
            row["eager"] = bench_ms(lambda: eager(b), **kw)
            hand = HandWrittenGraph(model, b, pool)
            row["hand_graph"] = bench_ms(lambda: hand(b), **kw)
            del hand
            print(f"{name} bs={bs}: eager {row['eager']:.3f} ms, hand-written graph {row['hand_graph']:.3f} ms", flush=True)
        results.save()

        if not args.quick:
            for bs in [b for b in args.reduce_overhead_bs if b in batches]:
                torch._dynamo.reset()
                start = time.perf_counter()
                try:
                    fn = reduce_overhead_fn(model, batches[bs])
                    for _ in range(3):
                        fn(batches[bs])
                    m["decode"][str(bs)]["reduce_overhead"] = bench_ms(lambda: fn(batches[bs]), **kw)
                    results.note(f"{name}: torch.compile reduce-overhead at bs={bs} compiled in {time.perf_counter() - start:.1f} s")
                except Exception as exc:  # a baseline failing must not stop the suite
                    results.note(f"{name}: torch.compile reduce-overhead failed at bs={bs}: {type(exc).__name__}: {exc}")
                torch._dynamo.reset()
            results.save()

        for backend, reason in available("decode", args.backends).items():
            if reason:
                results.note(f"{name}: decode backend {backend} skipped: {reason}")
                continue
            try:
                # A fresh pool per measurement, so one backend's leftovers never hide another's memory.
                runner = DecodeCudaGraphRunner(
                    model, {"decode": {**phase_options(backend), "max_bs": max(256, max(bs_list))}}, show_progress=False,
                    backend=fresh_backend("decode", backend))
                runner.capture()
                cap = m["capture"].setdefault(backend, {})
                cap.update(sizes=len(runner.capture_sizes), capture_s=runner.capture_seconds,
                           pool_mb=(runner.capture_memory_bytes or 0) / 2**20)
                if getattr(runner.backend, "compile_seconds", None) is not None:
                    cap["compile_s"] = runner.backend.compile_seconds
                for bs in bs_list:
                    b = batches[bs]
                    m["decode"][str(bs)][backend] = bench_ms(lambda: runner.forward(b), **kw)
                    diff = float((runner.forward(b).clone() - eager(b)).abs().max())  # never hold a replay's alias
                    m.setdefault("max_abs_diff_vs_eager", {}).setdefault(backend, {})[str(bs)] = diff
                calls = getattr(runner.backend, "piece_calls", None)
                if callable(calls):  # tc_piecewise: did every piece replay its graph?
                    cap["piece_calls"] = calls()
                    cap["dynamo_compiles"] = getattr(runner.backend, "dynamo_compiles", None)
                # Host-side cost of padding/copying a live batch (no device wait).
                b = batches[bs_list[0]]
                samples = []
                for _ in range(200):
                    start = time.perf_counter()
                    runner.replay_prepare(b)
                    samples.append((time.perf_counter() - start) * 1e6)
                sync()
                m["replay_prepare_us"][backend] = statistics.median(samples)
                runner.cleanup()
                del runner
                # The largest size alone: how much the shared pool saves.
                alone = DecodeCudaGraphRunner(model, {"decode": {**phase_options(backend), "bs": [256], "max_bs": 256}},
                                              show_progress=False, backend=fresh_backend("decode", backend))
                alone.capture()
                cap["largest_alone_mb"] = (alone.capture_memory_bytes or 0) / 2**20
                if cap["largest_alone_mb"]:
                    cap["pool_ratio"] = cap["pool_mb"] / cap["largest_alone_mb"]
                alone.cleanup()
                del alone
                print(f"{name} {backend}: " + ", ".join(f"bs={bs} {m['decode'][str(bs)][backend]:.3f}" for bs in bs_list), flush=True)
            except Exception as exc:
                results.note(f"{name}: decode backend {backend} failed: {type(exc).__name__}: {exc}")
            torch.cuda.empty_cache()
            results.save()

        if args.prefill_tokens:
            from cuda_graph_runner.runner import PrefillCudaGraphRunner

            max_tokens = max(args.prefill_tokens)
            # 4 requests per batch, every batch alive at once (re-running one rewrites its own slots).
            n = len(args.prefill_tokens)
            model.create_kv_cache(num_slots=sum(args.prefill_tokens) + 1, max_reqs=4 * n + 1,
                                  max_context_len=max_tokens // 4 + 1)
            prefill_batches = {}
            for t in args.prefill_tokens:
                lengths = [t // 4 + (1 if i < t % 4 else 0) for i in range(4)]
                prefill_batches[t] = make_extend_batch(model.kv_cache, make_dummy_prompts(4, lengths, model.config.vocab_size))
                m["prefill"].setdefault(str(t), {})["eager"] = bench_ms(lambda: eager(prefill_batches[t]), **kw)
            for backend, reason in available("prefill", args.backends).items():
                if reason:
                    results.note(f"{name}: prefill backend {backend} skipped: {reason}")
                    continue
                try:
                    runner = PrefillCudaGraphRunner(model, {"prefill": {**phase_options(backend), "max_bs": max_tokens}},
                                                    show_progress=False, backend=fresh_backend("prefill", backend))
                    runner.capture()
                    m["capture"][f"{backend} (prefill)"] = {"sizes": len(runner.capture_sizes),
                                                            "capture_s": runner.capture_seconds,
                                                            "pool_mb": (runner.capture_memory_bytes or 0) / 2**20}
                    for t, b in prefill_batches.items():
                        m["prefill"][str(t)][backend] = bench_ms(lambda: runner.forward(b), **kw)
                    runner.cleanup()
                    del runner
                except Exception as exc:
                    results.note(f"{name}: prefill backend {backend} failed: {type(exc).__name__}: {exc}")
                torch.cuda.empty_cache()
                results.save()
    del model
    torch.cuda.empty_cache()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"), help="output folder (default $OUT or ./out)")
    parser.add_argument("--models", nargs="+", default=["llama-3.2-1b", "qwen2.5-0.5b"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=DECODE_BS)
    parser.add_argument("--backends", default="full,breakable,tc_piecewise,tc_piecewise:inductor",
                        help="comma-separated backends (name[:tc_compiler]) to bench where installed and usable")
    parser.add_argument("--reduce-overhead-bs", type=int, nargs="*", default=[1, 32],
                        help="batch sizes for the torch.compile reduce-overhead baseline (slow to compile)")
    parser.add_argument("--prefill-tokens", type=int, nargs="*", default=PREFILL_TOKENS)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="skip the torch.compile baseline")
    args = parser.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not torch.cuda.is_available():
        print("benchmarks/run.py needs a CUDA device", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "date": datetime.date.today().isoformat()}
    results = Results(args.out, env)
    for name in args.models:
        run_model(name, args, results)
    results.save()
    print(to_markdown(results.data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
