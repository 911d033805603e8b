#!/usr/bin/env python3
"""Does a compiled method's decode time depend on what else its process compiled? An A/B in one call.

tc_piecewise:inductor decode is timed against the hand-written CUDA graph (run.py's
``HandWrittenGraph``, measured in the same process, so every ratio is within-process) in
one fresh child process per *variant*:

* ``alone``: only the hand graph and tc_piecewise:inductor are built;
* ``beside``: first ``torch.compile(mode="reduce-overhead")`` at every size and compiled
  full (``full+torch_compile``, the sizes as compile sizes) are compiled and run, as in
  run.py's single process, then tc_piecewise:inductor. Timed three times in the same
  process: ``all`` (every method interleaved, run.py's rounds), ``pair`` (hand graph and
  tc_piecewise only: is it the interleaving), ``trees_freed`` (after
  ``cudagraph_trees.reset_cudagraph_trees()``: reduce-overhead's CUDA-graph trees and the
  cached-tensor mode they switch on are gone) and ``others_freed`` (compiled full's runner
  cleaned up too);
* ``beside_reset``: as ``beside``, with ``torch._dynamo.reset()`` between the others and
  tc_piecewise (Dynamo's code caches, guards, recompile counts and the trees dropped);
* ``beside_fresh_cache``: as ``beside`` with an empty inductor and Triton cache dir
  (``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``) for the child alone;
* ``beside_limit``: as ``beside`` with Dynamo's recompile limit (``recompile_limit`` /
  ``cache_size_limit``, and ``accumulated_recompile_limit``) raised to 64 first.

Each child records Dynamo's counters (``torch._dynamo.utils.counters``) after the others
and after tc_piecewise, the cache entries on the model's forward code objects, the inductor
config keys the others left changed, whether reduce-overhead's CUDA-graph tree manager is
alive, and tc_piecewise's own compile count, piece calls and direct-replay keys.

How it stays inside its time (``--budget-s``, default 270): children compile in parallel
waves and are timed one at a time (a child that finished building waits for its turn, so
no compile runs beside a timed block): wave 1 is ``alone`` and ``beside``; wave 2 takes the
other variants that still fit the budget, judged by wave 1's build time (the inductor cache
is warm by then, except for ``beside_fresh_cache``). A child not ready or not done in time
is killed (its process group) and reported as such. Timing per child: ``--rounds``
measured rounds (default 5) of ``--iters`` calls after a short warm-up, three sizes.

Usage (device machine)::

    timeout 300 python benchmarks/isolation_ab.py --out $OUT/isolation --budget-s 270

Output: a table (variant, phase, batch size, tc_piecewise:inductor / hand_graph median
[lo-hi], hand graph ms) and ``OUT/isolation_ab.json`` with every child's cells and probes.
Reading it: ``alone`` against ``beside/all`` is the effect; ``beside/pair`` equal to
``beside/all`` rules out the interleaving, ``beside/trees_freed`` back at ``alone`` names
the CUDA-graph trees, ``beside_reset`` back at ``alone`` with ``trees_freed`` not names
Dynamo's caches, ``beside_limit`` back at ``alone`` names the recompile limit (then the
counters show the limit hit), ``beside_fresh_cache`` back at ``alone`` names inductor's
on-disk cache (a kernel compiled for another method reused).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

TC = "tc_piecewise:inductor"
FULL_TC = "full+torch_compile"
VARIANTS = {
    # name: (others built first, dynamo reset before tc, fresh cache dir, raised recompile limit)
    "alone": (False, False, False, False),
    "beside": (True, False, False, False),
    "beside_reset": (True, True, False, False),
    "beside_fresh_cache": (True, False, True, False),
    "beside_limit": (True, False, False, True),
}
WAVE_1 = ["alone", "beside"]
RAISED_LIMIT = 64


# -- the child: build, wait for its turn, time -------------------------------------------------


def _counters() -> Dict[str, Dict[str, int]]:
    from torch._dynamo.utils import counters

    out: Dict[str, Dict[str, int]] = {}
    for group, counter in counters.items():
        items = dict(counter)
        if group == "graph_break":  # reasons are long strings: their count is what matters here
            out[group] = {"total": int(sum(items.values())), "distinct": len(items)}
        else:
            out[group] = {str(k): int(v) for k, v in items.items()}
    return out


def _cache_entries(model: Any, tc_backend: Any = None) -> Dict[str, int]:
    """Dynamo cache entries on the model's forward code objects (shared by every torch.compile
    that traces them) and on tc_piecewise's compiled entry."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    out = {}
    codes = {"model.forward": type(model).forward}
    entry = getattr(getattr(tc_backend, "_compiled", None), "_torchdynamo_orig_callable", None)
    if entry is not None and hasattr(entry, "__code__"):
        codes["tc_entry"] = entry
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is not None and len(layers):
        codes["layer.forward"] = type(layers[0]).forward
    for name, fn in codes.items():
        try:
            out[name] = len(_debug_get_cache_entry_list(fn.__code__))
        except Exception as exc:  # a private API: say so instead of failing the run
            out[name] = -1
            out[name + "_error"] = f"{type(exc).__name__}: {exc}"[:120]  # type: ignore[assignment]
    return out


def _trees_alive() -> Optional[bool]:
    try:
        import torch
        from torch._inductor import cudagraph_trees

        if not torch._C._is_key_in_tls("tree_manager_containers"):
            return False
        return cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False) is not None
    except Exception:
        return None


def _inductor_config() -> Dict[str, Any]:
    import torch._inductor.config as ic

    return {k: repr(v)[:80] for k, v in ic.get_config_copy().items()}


def _recompile_limits() -> Dict[str, Any]:
    import torch._dynamo.config as dc

    return {
        k: getattr(dc, k)
        for k in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit")
        if hasattr(dc, k)
    }


def child(args: argparse.Namespace) -> int:
    import torch
    from bench_rounds import run_rounds
    from bench_summary import ratio_stats
    from run import HandWrittenGraph, decode_batches, fresh_backend, phase_options, pin_inductor, reduce_overhead_fn

    from cuda_graph_runner.reference.model import DEFAULT_ATTENTION, ReferenceLlamaForCausalLM
    from cuda_graph_runner.runner import DecodeCudaGraphRunner

    others, reset, _fresh, limit = VARIANTS[args.child]
    out: Dict[str, Any] = {"variant": args.child, "torch": torch.__version__, "notes": [], "phases": {}}
    t0 = time.perf_counter()
    if limit:
        import torch._dynamo.config as dc

        for key in ("recompile_limit", "cache_size_limit"):
            if hasattr(dc, key):
                setattr(dc, key, RAISED_LIMIT)
        if hasattr(dc, "accumulated_recompile_limit"):
            dc.accumulated_recompile_limit = max(4 * RAISED_LIMIT, dc.accumulated_recompile_limit)
    out["recompile_limits"] = _recompile_limits()
    out["inductor_cache_dir"] = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    out["inductor_config"] = pin_inductor("pinned")
    sizes = sorted(args.batch_sizes)
    model = ReferenceLlamaForCausalLM.from_preset(
        args.model, dtype=torch.bfloat16, device="cuda", attention=DEFAULT_ATTENTION
    )
    context = args.prompt_len + 16
    max_reqs = sum(sizes) + 2
    model.create_kv_cache(num_slots=max_reqs * context + 1, max_reqs=max_reqs, max_context_len=context)
    batches = decode_batches(model, sizes, args.prompt_len)
    pool = torch.cuda.graph_pool_handle()
    methods: Dict[int, Dict[str, Any]] = {bs: {} for bs in sizes}
    build_s: Dict[str, float] = {}
    full_runner = None
    with torch.no_grad():
        for bs in sizes:
            hand = HandWrittenGraph(model, batches[bs], pool)
            methods[bs]["hand_graph"] = lambda b=batches[bs], h=hand: h(b)
        config_before = _inductor_config()
        if others:
            start = time.perf_counter()
            torch._dynamo.reset()  # as run.py does once before reduce-overhead
            for bs in sizes:
                fn = reduce_overhead_fn(model, batches[bs])
                for _ in range(3):
                    fn(batches[bs])
                methods[bs]["reduce_overhead"] = lambda fn=fn, b=batches[bs]: fn(b)
            build_s["reduce_overhead"] = time.perf_counter() - start
            print(f"[{args.child}] reduce_overhead built in {build_s['reduce_overhead']:.1f} s", flush=True)
            start = time.perf_counter()
            full_runner = DecodeCudaGraphRunner(
                model,
                {"decode": {**phase_options(FULL_TC, sizes), "max_bs": 256}},
                show_progress=False,
                backend=fresh_backend("decode", FULL_TC, sizes),
            )
            full_runner.capture()
            for bs in sizes:
                full_runner.forward(batches[bs])
                methods[bs][FULL_TC] = lambda b=batches[bs], r=full_runner: r.forward(b)
            build_s[FULL_TC] = time.perf_counter() - start
            print(f"[{args.child}] {FULL_TC} built in {build_s[FULL_TC]:.1f} s", flush=True)
            after = _inductor_config()
            out["inductor_config_changed_by_others"] = {
                k: [config_before.get(k), v] for k, v in after.items() if config_before.get(k) != v
            }
        out["after_others"] = {
            "counters": _counters(),
            "cache_entries": _cache_entries(model),
            "cudagraph_trees_alive": _trees_alive(),
        }
        if reset:
            torch._dynamo.reset()  # drops the others' compiled code: they are not timed after this
            for bs in sizes:
                methods[bs].pop("reduce_overhead", None)
                methods[bs].pop(FULL_TC, None)
            out["after_reset"] = {"cudagraph_trees_alive": _trees_alive(), "cache_entries": _cache_entries(model)}
        start = time.perf_counter()
        runner = DecodeCudaGraphRunner(
            model,
            {"decode": {**phase_options(TC), "max_bs": 256}},
            show_progress=False,
            backend=fresh_backend("decode", TC),
        )
        runner.capture()
        for bs in sizes:
            runner.forward(batches[bs])
            methods[bs][TC] = lambda b=batches[bs], r=runner: r.forward(b)
        build_s[TC] = time.perf_counter() - start
        torch.cuda.synchronize()
        out["after_tc"] = {
            "counters": _counters(),
            "cache_entries": _cache_entries(model, runner.backend),
            "cudagraph_trees_alive": _trees_alive(),
            "recompile_limits": _recompile_limits(),
        }
    out["build_s"] = {k: round(v, 1) for k, v in build_s.items()}
    out["build_total_s"] = round(time.perf_counter() - t0, 1)
    print(f"[{args.child}] built in {out['build_total_s']} s: {out['build_s']}", flush=True)

    # Wait for the parent's go: no compile of another child runs while this one times.
    ready, go = os.path.join(args.sync_dir, args.child + ".ready"), os.path.join(args.sync_dir, args.child + ".go")
    with open(ready, "w") as f:
        f.write(str(out["build_total_s"]))
    while not os.path.exists(go):
        time.sleep(0.05)

    def save() -> None:  # after every phase: a child killed later keeps what it measured
        with open(args.json + ".tmp", "w") as f:
            json.dump(out, f, indent=1)
        os.replace(args.json + ".tmp", args.json)

    def time_phase(phase: str, names: List[str]) -> None:
        cells_by_bs: Dict[str, Any] = {}
        gc.collect()
        gc.freeze()
        try:
            with torch.no_grad():
                for bs in sizes:
                    fns = {n: methods[bs][n] for n in names if n in methods[bs]}
                    cells = run_rounds(
                        fns,
                        iters=args.iters,
                        rounds=args.rounds,
                        sync=torch.cuda.synchronize,
                        warmup_min=2,
                        warmup_max=args.warmup_max,
                        warmup_min_s=args.warmup_min_s,
                    )
                    summary = {n: c.summary() for n, c in cells.items()}
                    row: Dict[str, Any] = {
                        n: {"median_ms": s["median_ms"], "samples_ms": s["samples_ms"], "steady": s["steady"]}
                        for n, s in summary.items()
                    }
                    row["ratio_tc_hand"] = ratio_stats(summary[TC], summary["hand_graph"])
                    cells_by_bs[str(bs)] = row
        except Exception as exc:  # one phase failing must not lose the others
            out["notes"].append(f"{phase}: {type(exc).__name__}: {exc}"[:300])
        finally:
            gc.unfreeze()
        out["phases"][phase] = cells_by_bs
        out["timing_s"] = round(time.perf_counter() - t_time, 1)
        save()
        print(
            f"[{args.child}] {phase}: "
            + ", ".join(
                f"bs={bs} {r['ratio_tc_hand']['median']:.3f}" for bs, r in cells_by_bs.items() if r["ratio_tc_hand"]
            ),
            flush=True,
        )

    t_time = time.perf_counter()
    if others and not reset:
        time_phase("all", ["hand_graph", "reduce_overhead", FULL_TC, TC])
    time_phase("pair", ["hand_graph", TC])
    if others and not reset:
        from torch._inductor import cudagraph_trees

        for bs in sizes:
            methods[bs].pop("reduce_overhead", None)
        cudagraph_trees.reset_cudagraph_trees()
        out["after_trees_freed"] = {"cudagraph_trees_alive": _trees_alive()}
        time_phase("trees_freed", ["hand_graph", TC])
        if full_runner is not None:
            for bs in sizes:
                methods[bs].pop(FULL_TC, None)
            full_runner.cleanup()
            full_runner = None
            gc.collect()
            time_phase("others_freed", ["hand_graph", TC])
    out["timing_s"] = round(time.perf_counter() - t_time, 1)
    backend = runner.backend
    out["tc"] = {
        "dynamo_compiles": getattr(backend, "dynamo_compiles", None),
        "piece_calls": backend.piece_calls() if callable(getattr(backend, "piece_calls", None)) else None,
        "direct_replay": {str(k): v is not None for k, v in (getattr(backend, "_direct", None) or {}).items()},
    }
    out["final_counters"] = _counters()
    save()
    return 0


# -- the parent: waves, turns, the table --------------------------------------------------------


class Child:
    def __init__(self, variant: str, args: argparse.Namespace, sync_dir: str) -> None:
        self.variant = variant
        self.sync_dir = sync_dir
        self.json = os.path.join(args.out, f"{variant}.json")
        self.log = os.path.join(args.out, f"{variant}.log")
        env = dict(os.environ)
        if VARIANTS[variant][2]:
            fresh = tempfile.mkdtemp(prefix="isolation-ab-cache-")
            env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(fresh, "inductor")
            env["TRITON_CACHE_DIR"] = os.path.join(fresh, "triton")
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--child", variant,
            "--json", self.json,
            "--sync-dir", sync_dir,
            "--model", args.model,
            "--batch-sizes", *[str(b) for b in args.batch_sizes],
            "--rounds", str(args.rounds),
            "--iters", str(args.iters),
            "--warmup-max", str(args.warmup_max),
            "--warmup-min-s", str(args.warmup_min_s),
            "--prompt-len", str(args.prompt_len),
        ]  # fmt: skip
        self.started = time.time()
        self.logf = open(self.log, "w")
        # A session of its own: the kill at the deadline takes the compile workers too.
        self.proc = subprocess.Popen(cmd, stdout=self.logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.status = "running"

    def ready(self) -> bool:
        return os.path.exists(os.path.join(self.sync_dir, self.variant + ".ready"))

    def kill(self, why: str) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.status = why

    def tail(self) -> str:
        with open(self.log) as f:
            return "".join(f.readlines()[-6:])


def run_wave(variants: List[str], args: argparse.Namespace, sync_dir: str, deadline: float) -> Dict[str, Any]:
    children = [Child(v, args, sync_dir) for v in variants]
    results: Dict[str, Any] = {}
    # Build: all in parallel, until each is ready, gone, or the time left is only the timing reserve.
    build_deadline = deadline - args.timing_reserve_s * len(children)
    while any(c.proc.poll() is None and not c.ready() for c in children) and time.time() < build_deadline:
        time.sleep(0.2)
    for c in children:
        if c.proc.poll() is not None and not c.ready():
            c.status = f"exited {c.proc.returncode} while building"
        elif not c.ready():
            c.kill("killed: not built in time")
    # Time: one child at a time.
    for c in children:
        if c.status != "running":
            continue
        open(os.path.join(sync_dir, c.variant + ".go"), "w").close()
        try:
            c.proc.wait(timeout=max(1.0, deadline - time.time()))
            c.status = "done" if c.proc.returncode == 0 else f"exited {c.proc.returncode} while timing"
        except subprocess.TimeoutExpired:
            c.kill("killed: not timed in time")
    for c in children:
        c.logf.close()
        entry: Dict[str, Any] = {"status": c.status, "wall_s": round(time.time() - c.started, 1)}
        if os.path.exists(c.json):  # partial when the child died while timing
            with open(c.json) as f:
                entry.update(json.load(f))
        if c.status != "done":
            entry["log_tail"] = c.tail()
        results[c.variant] = entry
        print(f"{c.variant}: {c.status} ({entry['wall_s']} s)", flush=True)
    return results


def table(results: Dict[str, Any]) -> str:
    lines = [
        "| variant | phase | bs | tc/hand median [lo-hi] | tc ms | hand ms | steady |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant, r in results.items():
        if r.get("status") != "done":
            lines.append(f"| {variant} | {r.get('status')} | | | | | |")
        for phase, rows in (r.get("phases") or {}).items():
            for bs, row in rows.items():
                s = row.get("ratio_tc_hand")
                ratio = f"{s['median']:.3f} [{s['lo']:.3f}-{s['hi']:.3f}]" if s else "-"
                steady = all(v.get("steady", True) for k, v in row.items() if isinstance(v, dict) and "median_ms" in v)
                lines.append(
                    f"| {variant} | {phase} | {bs} | {ratio} | {row[TC]['median_ms']:.3f} | "
                    f"{row['hand_graph']['median_ms']:.3f} | {'yes' if steady else 'no'} |"
                )
    lines.append("")
    lines.append(
        "| variant | build s | frames ok (after others/after tc) | unique graphs | recompiles | forward cache entries | trees alive | tc compiles | direct replay |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for variant, r in results.items():
        if "after_tc" not in r:
            continue
        a, t = r.get("after_others", {}), r.get("after_tc", {})

        def ok(x: Dict[str, Any]) -> Any:
            return x.get("counters", {}).get("frames", {}).get("ok")

        stats = t.get("counters", {}).get("stats", {})
        recompiles = sum((t.get("counters", {}).get("recompiles") or {}).values())
        direct = r.get("tc", {}).get("direct_replay", {})
        lines.append(
            f"| {variant} | {r.get('build_total_s')} | {ok(a)}/{ok(t)} | {stats.get('unique_graphs')} | {recompiles} | "
            f"{a.get('cache_entries', {}).get('model.forward')}/{t.get('cache_entries', {}).get('model.forward')} | "
            f"{a.get('cudagraph_trees_alive')}/{t.get('cudagraph_trees_alive')} | {r.get('tc', {}).get('dynamo_compiles')} | "
            f"{sum(direct.values())}/{len(direct)} |"
        )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"), help="output folder")
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per size and phase")
    parser.add_argument("--iters", type=int, default=20, help="calls per timed block")
    parser.add_argument("--warmup-max", type=int, default=12)
    parser.add_argument("--warmup-min-s", type=float, default=0.5)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--budget-s", type=float, default=270.0, help="wall-clock seconds for everything")
    parser.add_argument("--timing-reserve-s", type=float, default=25.0, help="seconds of timing to keep per child")
    parser.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--sync-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    start = time.time()
    deadline = start + args.budget_s
    os.makedirs(args.out, exist_ok=True)
    sync_dir = tempfile.mkdtemp(prefix="isolation-ab-")
    results: Dict[str, Any] = {}
    wave1 = [v for v in WAVE_1 if v in args.variants]
    rest = [v for v in args.variants if v not in wave1]
    if wave1:
        results.update(run_wave(wave1, args, sync_dir, deadline))
    built = [r.get("build_total_s") for r in results.values() if r.get("build_total_s")]
    timed = [r.get("timing_s") for r in results.values() if r.get("timing_s")]
    # Wave 2 runs what fits: a warm cache makes a rebuild cheaper than wave 1's (a fresh dir does not).
    wave2: List[str] = []
    build = max(built) if built else args.budget_s / 2  # nothing built: assume the worst
    reserve = max(timed) if timed else args.timing_reserve_s
    for v in rest:
        need = (build if VARIANTS[v][2] else 0.6 * build) + reserve * (len(wave2) + 1) + 15
        if deadline - time.time() > need:
            wave2.append(v)
        else:
            results[v] = {"status": f"skipped: {need:.0f} s needed, {deadline - time.time():.0f} s left"}
    if wave2:
        results.update(run_wave(wave2, args, sync_dir, deadline))
    doc = {
        "model": args.model,
        "batch_sizes": args.batch_sizes,
        "rounds": args.rounds,
        "iters": args.iters,
        "wall_s": round(time.time() - start, 1),
        "variants": results,
    }
    path = os.path.join(args.out, "isolation_ab.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(table(results))
    for variant, r in results.items():
        if r.get("log_tail"):
            print(f"--- {variant} ({r['status']}), last lines of {variant}.log:\n{r['log_tail']}")
    print(f"wrote {path} ({doc['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
