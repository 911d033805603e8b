#!/usr/bin/env python3
"""Does a compiled method's decode time depend on what else its process compiled? An A/B in one call.

tc_piecewise:inductor decode is timed against the hand-written CUDA graph (run.py's
``HandWrittenGraph``, built and timed in the same process, so every ratio is
within-process) in one fresh child process per *arm*. The others an arm builds first are
``reduce_overhead`` (``torch.compile(mode="reduce-overhead")``, one static entry per
measured size, as run.py builds it) and compiled full (``full+torch_compile``, the measured
sizes as its compile sizes and its only capture sizes); tc_piecewise:inductor keeps run.py's
options (every default capture size). Arms:

* ``alone``, ``alone_again``: only the hand graph and tc_piecewise; two fresh processes,
  so their difference is the process-to-process spread any other arm is read against;
* ``beside_both``: reduce-overhead and compiled full first, then tc_piecewise (run.py's
  single process without ``--isolate``, less its graph backends that compile nothing);
* ``beside_ro`` / ``beside_full``: only one of the others first;
* ``beside_both_reset``: as ``beside_both``, ``torch._dynamo.reset()`` before
  tc_piecewise (Dynamo's code caches, guards and recompile counts dropped);
* ``beside_both_no_trees``: as ``beside_both`` with inductor's CUDA-graph trees off
  (``triton.cudagraph_trees=False``: reduce-overhead records its graphs without the tree
  manager, its private pool and the cached-tensor mode);
* ``beside_both_limit`` (not run by default): Dynamo's recompile limits raised to 64;
* ``beside_both_fresh_cache`` (not run by default): an empty inductor and Triton cache dir.

Phases timed in one child (each ``--rounds`` rounds of ``--iters`` calls per size, the
order rotated each round, after a warm-up to steady state): ``all`` (every built method
interleaved, as run.py's rounds), ``pair`` (hand graph and tc_piecewise only: is it the
interleaving), ``trees_freed`` (after ``cudagraph_trees.reset_cudagraph_trees()``) and
``others_freed`` (compiled full's runner cleaned up and reduce-overhead dropped too).

Each child records, after the others and after tc_piecewise: Dynamo's counters
(``torch._dynamo.utils.counters``), the recompile-limit warnings Dynamo logged
(``torch._dynamo hit config.recompile_limit``), the cache entries on the compiled code
objects, the recompile limits, the inductor config keys the others left changed, whether a
CUDA-graph tree manager is alive, a host-speed probe and the thread count; then
tc_piecewise's own compile count and direct-replay keys.

How it stays inside ``--budget-s`` (default 390; 60 with ``--device cpu``): children build
in parallel waves and are timed one at a time (a built child waits for its turn, so no
compile runs beside a timed block). Wave 1 is ``alone``, ``beside_both`` and the arms that
would miss a warm cache anyway (``beside_both_no_trees``: another inductor config;
``beside_both_fresh_cache``), all compiling cold; wave 2 the other arms that fit by wave
1's build and timing seconds (on the cache wave 1 warmed), in the order given. A child not
built or not timed in time is killed (its process group) and reported as such. However the
parent ends (SIGTERM and SIGINT included, as from ``timeout``) it kills every child's
process group first; a child whose parent is gone (killed outright) or that is
``CHILD_GRACE_S`` past the deadline leaves on its own, so no child is left holding device
memory.

Usage (device machine; about 330 s)::

    timeout 420 python benchmarks/isolation_ab.py --out $OUT/isolation --budget-s 390

CPU smoke of the harness (``--device cpu``: the tiny preset, float32, the hand graph run
eagerly, the compiled methods as ``torch.compile(backend="eager")`` stand-ins; no timing
claims). Its defaults are a smoke's (:data:`DEVICE_DEFAULTS`): the arms ``alone`` and
``beside_ro`` (one per wave), batch sizes 1 and 4, one round of one call per size and
phase, at most 2 warm-up rounds, ``--budget-s`` 60, ``--timing-reserve-s`` 10 (about 30 s
on two cores); each option given replaces its default::

    python benchmarks/isolation_ab.py --device cpu --out /tmp/iso

Output: tables (arm, phase: tc_piecewise / hand graph median [lo-hi] per size; the
probes per arm) on stdout and in ``OUT/isolation_ab.txt``, ``OUT/isolation_ab.json`` with
every child's cells and probes (absolute paths made portable: both can be stored as they
are), and ``OUT/arms/`` with each child's log and JSON (an arm's JSON from an earlier run
into the same folder is removed before its child starts).

Exit status 0 when at least one arm finished, 1 when none did (each arm's status on
stderr), 2 for bad input (named on stderr before any child starts).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

TC = "tc_piecewise:inductor"
FULL_TC = "full+torch_compile"
RO = "reduce_overhead"
RAISED_LIMIT = 64
#: The largest batch size: every runner here is built with this ``max_bs`` (run.py's).
MAX_BS = 256
#: The least warm-up rounds of every timed cell (``--warmup-max`` may not be below it).
WARMUP_MIN = 2
#: An absolute path in a log line (a warning's source file, a cache folder).
ABS_PATH = re.compile(r"(?<![\w.<>~-])/[^\s:'\"(),]+")


def scrub(text: str) -> str:
    """``text`` with every absolute path made portable (``portable.portable_path``): the
    stored output names nothing of the machine."""
    from portable import portable_path

    return ABS_PATH.sub(lambda m: portable_path(m.group(0)), text)


@dataclass(frozen=True)
class Arm:
    """What one child builds before tc_piecewise and how."""

    others: Tuple[str, ...] = ()  # built and run before tc_piecewise, in this order
    reset: bool = False  # torch._dynamo.reset() before tc_piecewise
    no_trees: bool = False  # inductor's triton.cudagraph_trees off
    raised_limit: bool = False  # Dynamo's recompile limits raised to RAISED_LIMIT
    fresh_cache: bool = False  # an empty TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR
    wave: int = 2

    def phases(self) -> List[str]:
        if self.reset or not self.others:
            return ["pair"]
        out = ["all", "pair"]
        if RO in self.others and not self.no_trees:
            out.append("trees_freed")
        if FULL_TC in self.others or self.no_trees:
            out.append("others_freed")
        return out

    def cold(self) -> bool:
        """Its build misses the cache wave 1 warmed (a fresh dir; tree-less graphs)."""
        return self.fresh_cache or self.no_trees


ARMS: Dict[str, Arm] = {
    "alone": Arm(wave=1),
    "beside_both": Arm((RO, FULL_TC), wave=1),
    "beside_ro": Arm((RO,)),
    "beside_full": Arm((FULL_TC,)),
    "alone_again": Arm(),
    "beside_both_reset": Arm((RO, FULL_TC), reset=True),
    # Cold anyway (another inductor config, another cache dir): built beside wave 1's.
    "beside_both_no_trees": Arm((RO, FULL_TC), no_trees=True, wave=1),
    "beside_both_fresh_cache": Arm((RO, FULL_TC), fresh_cache=True, wave=1),
    "beside_both_limit": Arm((RO, FULL_TC), raised_limit=True),
}
DEFAULT_ARMS = [
    "alone",
    "beside_both",
    "beside_both_no_trees",
    "alone_again",  # first of wave 2: without the spread between processes no difference reads
    "beside_ro",
    "beside_full",
    "beside_both_reset",
]

#: The defaults of the options that depend on ``--device`` (an option given replaces its
#: default): on cuda a measurement; on cpu a smoke of the harness, well under a minute (one
#: arm per wave, one round of one call per size and phase, a short warm-up).
DEVICE_DEFAULTS: Dict[str, Dict[str, Any]] = {
    "cuda": {
        "model": "llama-3.2-1b",
        "batch_sizes": [1, 32, 128],
        "arms": DEFAULT_ARMS,
        "rounds": 5,
        "iters": 20,
        "warmup_max": 12,
        "warmup_min_s": 0.5,
        "budget_s": 390.0,
        "timing_reserve_s": 25.0,
    },
    "cpu": {
        "model": "tiny",
        "batch_sizes": [1, 4],
        "arms": ["alone", "beside_ro"],
        "rounds": 1,
        "iters": 1,
        "warmup_max": 2,
        "warmup_min_s": 0.0,
        "budget_s": 60.0,
        "timing_reserve_s": 10.0,
    },
}


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with each option not given (None) set to its ``--device``'s default
    (:data:`DEVICE_DEFAULTS`)."""
    for key, value in DEVICE_DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, list(value) if isinstance(value, list) else value)
    return args


def _default(key: str) -> str:
    """The cuda and cpu defaults of ``key`` as ``--help`` gives them: ``default 5; cpu: 1``."""

    def shown(value: Any) -> str:
        if isinstance(value, list):
            return " ".join(map(str, value))
        return f"{value:g}" if isinstance(value, float) else str(value)

    return f"default {shown(DEVICE_DEFAULTS['cuda'][key])}; cpu: {shown(DEVICE_DEFAULTS['cpu'][key])}"


# -- the child: build, wait for its turn, time -------------------------------------------------


class LimitHits(logging.Handler):
    """Counts Dynamo's ``hit config.<limit>`` warnings, by limit and function."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.hits: Dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        msg = str(record.msg)
        if msg.startswith("torch._dynamo hit config."):
            try:
                args = record.args if isinstance(record.args, tuple) else ()
                key = f"{args[0]} in {args[2]}" if len(args) >= 3 else record.getMessage().splitlines()[0]
            except Exception:  # a changed message format: count it under its first line
                key = msg.splitlines()[0]
            self.hits[key] = self.hits.get(key, 0) + 1


def _counters() -> Dict[str, Dict[str, int]]:
    from torch._dynamo.utils import counters

    out: Dict[str, Dict[str, int]] = {}
    for group, counter in counters.items():
        items = dict(counter)
        if group in ("graph_break", "unimplemented"):  # reasons are long strings: counts, and the limit ones
            out[group] = {
                "total": int(sum(items.values())),
                "distinct": len(items),
                "recompile_limit": int(sum(v for k, v in items.items() if "limit" in str(k).lower())),
            }
        elif group == "aten_mm_info":  # shapes of the matmuls: not a cause
            continue
        else:
            out[group] = {str(k): int(v) for k, v in items.items()}
    return out


def _cache_entries(codes: Dict[str, Any]) -> Dict[str, Any]:
    """Dynamo cache entries on each function's code object (a private API: -1 and the error
    when it is missing)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    out: Dict[str, Any] = {}
    for name, fn in codes.items():
        code = getattr(fn, "__code__", None)
        if code is None:
            continue
        try:
            out[name] = len(_debug_get_cache_entry_list(code))
        except Exception as exc:
            out[name] = -1
            out[name + "_error"] = f"{type(exc).__name__}: {exc}"[:120]
    return out


def _trees_alive() -> Optional[bool]:
    try:
        import torch
        from torch._inductor import cudagraph_trees

        if not torch.cuda.is_available() or not torch._C._is_key_in_tls("tree_manager_containers"):
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


def _threads() -> int:
    try:  # every thread of the process, not only Python's
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return threading.active_count()


#: Exit status of a child that left on its own: its deadline passed or its parent is gone.
ORPHAN_EXIT = 3


def orphaned(deadline: Optional[float], parent_pid: Optional[int]) -> Optional[str]:
    """Why a child should leave now, or None: ``deadline`` (epoch seconds) has passed, or
    its parent ``parent_pid`` is gone (this process was handed to another parent)."""
    if deadline is not None and time.time() > deadline:
        return f"its deadline passed ({time.time() - deadline:.1f} s ago)"
    if parent_pid is not None and os.getppid() != parent_pid:
        return f"its parent {parent_pid} is gone"
    return None


def leave_if_orphaned(deadline: Optional[float], parent_pid: Optional[int]) -> None:
    """End this child when :func:`orphaned` says so: a parent killed without its
    ``finally`` leaves no child behind that holds device memory. A child that leads its
    own process group (as the parent starts it) is killed with the group (SIGKILL: its
    compile workers too); another exits with status :data:`ORPHAN_EXIT`."""
    why = orphaned(deadline, parent_pid)
    if why is None:
        return
    print(f"child {os.getpid()} leaves: {why}", file=sys.stderr, flush=True)
    if os.getpgrp() == os.getpid():  # its own process group (the parent's start_new_session)
        try:
            os.killpg(os.getpid(), signal.SIGKILL)  # its workers and itself
        except OSError:
            pass
    os._exit(ORPHAN_EXIT)


def watch_parent(deadline: Optional[float], parent_pid: Optional[int], every_s: float = 0.5) -> threading.Thread:
    """A daemon thread that calls :func:`leave_if_orphaned` every ``every_s`` seconds, so a
    child stuck in a build or a timed block leaves too."""

    def loop() -> None:
        while True:
            leave_if_orphaned(deadline, parent_pid)
            time.sleep(every_s)

    thread = threading.Thread(target=loop, name="isolation-ab-watchdog", daemon=True)
    thread.start()
    return thread


def child(args: argparse.Namespace) -> int:
    watch_parent(args.deadline, args.parent_pid)
    import torch
    from bench_rounds import run_rounds
    from bench_summary import ratio_stats
    from run import (
        HandWrittenGraph,
        decode_batches,
        fresh_backend,
        host_probe_us,
        phase_options,
        pin_inductor,
        reduce_overhead_fn,
    )

    from cuda_graph_runner.reference.model import DEFAULT_ATTENTION, ReferenceLlamaForCausalLM
    from cuda_graph_runner.runner import DecodeCudaGraphRunner

    arm = ARMS[args.child]
    on_cuda = args.device == "cuda"
    sync: Callable[[], None] = torch.cuda.synchronize if on_cuda else (lambda: None)
    limit_hits = LimitHits()
    logging.getLogger("torch._dynamo").addHandler(limit_hits)
    out: Dict[str, Any] = {"arm": args.child, "spec": asdict(arm), "torch": torch.__version__, "notes": []}
    out["phases"] = {}
    t0 = time.perf_counter()
    if arm.raised_limit:
        import torch._dynamo.config as dc

        for key in ("recompile_limit", "cache_size_limit"):
            if hasattr(dc, key):
                setattr(dc, key, RAISED_LIMIT)
        if hasattr(dc, "accumulated_recompile_limit"):
            dc.accumulated_recompile_limit = max(4 * RAISED_LIMIT, dc.accumulated_recompile_limit)
    out["recompile_limits"] = _recompile_limits()
    out["inductor_cache_dir"] = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    out["inductor_config"] = pin_inductor("pinned")
    if arm.no_trees:
        import torch._inductor.config as ic

        ic.triton.cudagraph_trees = False
        out["inductor_config"]["triton.cudagraph_trees"] = False
    sizes = sorted(args.batch_sizes)
    model = ReferenceLlamaForCausalLM.from_preset(
        args.model,
        dtype=torch.bfloat16 if on_cuda else torch.float32,
        device=args.device,
        attention=DEFAULT_ATTENTION,
    )
    context = args.prompt_len + 16
    max_reqs = sum(sizes) + 2
    model.create_kv_cache(num_slots=max_reqs * context + 1, max_reqs=max_reqs, max_context_len=context)
    batches = decode_batches(model, sizes, args.prompt_len)
    pool = torch.cuda.graph_pool_handle() if on_cuda else None
    methods: Dict[int, Dict[str, Callable[[], Any]]] = {bs: {} for bs in sizes}
    build_s: Dict[str, float] = {}
    runners: Dict[str, Any] = {}
    ro_fns: List[Any] = []
    codes: Dict[str, Any] = {"model.forward": type(model).forward}
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is not None and len(layers):
        codes["layer.forward"] = type(layers[0]).forward

    def stand_in(name: str) -> None:
        # CPU smoke: the compiled method as a Dynamo-compiled eager function per size.
        for bs in sizes:
            fn = reduce_overhead_fn(model, batches[bs], backend="eager")
            fn(batches[bs])
            if name == RO:
                ro_fns.append(fn)
            methods[bs][name] = lambda fn=fn, b=batches[bs]: fn(b)

    def build_runner(label: str, compile_sizes: List[int], capture: Optional[List[int]]) -> Any:
        decode: Dict[str, Any] = {**phase_options(label, compile_sizes), "max_bs": MAX_BS}
        if capture:
            decode["bs"] = capture
        runner = DecodeCudaGraphRunner(
            model, {"decode": decode}, show_progress=False, backend=fresh_backend("decode", label, compile_sizes)
        )
        runner.capture()
        for bs in sizes:
            runner.forward(batches[bs])
            methods[bs][label] = lambda b=batches[bs], r=runner: r.forward(b)
        return runner

    def probe(stage: str) -> None:
        gc.collect()
        out[stage] = {
            "counters": _counters(),
            "recompile_limit_hits": dict(limit_hits.hits),
            "cache_entries": _cache_entries(codes),
            "cudagraph_trees_alive": _trees_alive(),
            "python_objects": len(gc.get_objects()),
            "threads": _threads(),
            "host_probe_us": round(min(host_probe_us() for _ in range(5)), 1),
        }

    with torch.no_grad():
        for bs in sizes:
            hand = HandWrittenGraph(model, batches[bs], pool, use_graph=on_cuda)
            methods[bs]["hand_graph"] = lambda b=batches[bs], h=hand: h(b)
        config_before = _inductor_config()
        if arm.others:
            torch._dynamo.reset()  # as run.py does once before reduce-overhead
        for name in arm.others:
            start = time.perf_counter()
            try:
                if not on_cuda:
                    stand_in(name)
                elif name == RO:
                    for bs in sizes:
                        fn = reduce_overhead_fn(model, batches[bs])
                        ro_fns.append(fn)
                        for _ in range(3):
                            fn(batches[bs])
                        methods[bs][RO] = lambda fn=fn, b=batches[bs]: fn(b)
                else:
                    runners[name] = build_runner(name, sizes, sizes)
            except Exception as exc:  # the arm goes on without it, and says so in its notes
                out["notes"].append(f"{name} failed to build: {type(exc).__name__}: {exc}"[:300])
                for bs in sizes:
                    methods[bs].pop(name, None)
                if name == RO:
                    ro_fns.clear()
            build_s[name] = round(time.perf_counter() - start, 1)
            print(f"[{args.child}] {name} built in {build_s[name]} s", flush=True)
        if ro_fns:
            from torch._dynamo.eval_frame import innermost_fn

            # The step function every size's compiled entry hangs on (one code object).
            codes["reduce_overhead.step"] = innermost_fn(ro_fns[0].compiled)
        after = _inductor_config()
        out["inductor_config_changed_by_others"] = {
            k: [config_before.get(k), v] for k, v in after.items() if config_before.get(k) != v
        }
        probe("after_others")
        if arm.reset:
            torch._dynamo.reset()  # drops the others' compiled code: they are not timed after this
            for bs in sizes:
                for name in arm.others:
                    methods[bs].pop(name, None)
            probe("after_reset")
        start = time.perf_counter()
        tc_backend = None
        if on_cuda:
            runners[TC] = build_runner(TC, [], None)
            tc_backend = runners[TC].backend
            entry = getattr(getattr(tc_backend, "_compiled", None), "_torchdynamo_orig_callable", None)
            if entry is not None:
                codes["tc_entry"] = entry
        else:
            stand_in(TC)
        build_s[TC] = round(time.perf_counter() - start, 1)
        sync()
        probe("after_tc")
        out["after_tc"]["recompile_limits"] = _recompile_limits()
    out["build_s"] = build_s
    out["build_total_s"] = round(time.perf_counter() - t0, 1)
    print(f"[{args.child}] built in {out['build_total_s']} s: {build_s}", flush=True)

    # Wait for the parent's go: no compile of another child runs while this one times.
    ready, go = os.path.join(args.sync_dir, args.child + ".ready"), os.path.join(args.sync_dir, args.child + ".go")
    with open(ready, "w") as f:
        f.write(str(out["build_total_s"]))
    while not os.path.exists(go):
        leave_if_orphaned(args.deadline, args.parent_pid)
        time.sleep(0.05)

    def save() -> None:  # after every phase: a child killed later keeps what it measured
        with open(args.json + ".tmp", "w") as f:
            json.dump(out, f, indent=1)
        os.replace(args.json + ".tmp", args.json)

    t_time = time.perf_counter()

    def time_phase(phase: str) -> None:
        cells_by_bs: Dict[str, Any] = {}
        gc.collect()
        gc.freeze()
        start = time.perf_counter()
        probe_us = round(min(host_probe_us() for _ in range(5)), 1)
        try:
            with torch.no_grad():
                for bs in sizes:
                    fns = dict(methods[bs]) if phase == "all" else {n: methods[bs][n] for n in ("hand_graph", TC)}
                    cells = run_rounds(
                        fns,
                        iters=args.iters,
                        rounds=args.rounds,
                        sync=sync,
                        warmup_min=WARMUP_MIN,
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
        out["phases"][phase] = {
            "methods": sorted(methods[sizes[0]]) if phase == "all" else ["hand_graph", TC],
            "host_probe_us": probe_us,
            "threads": _threads(),
            "seconds": round(time.perf_counter() - start, 1),
            "by_bs": cells_by_bs,
        }
        out["timing_s"] = round(time.perf_counter() - t_time, 1)
        save()
        print(
            f"[{args.child}] {phase}: "
            + ", ".join(
                f"bs={bs} {r['ratio_tc_hand']['median']:.3f}" for bs, r in cells_by_bs.items() if r["ratio_tc_hand"]
            ),
            flush=True,
        )

    for phase in arm.phases():
        if phase == "trees_freed":
            from torch._inductor import cudagraph_trees

            for bs in sizes:
                methods[bs].pop(RO, None)
            cudagraph_trees.reset_cudagraph_trees()
            out["after_trees_freed"] = {"cudagraph_trees_alive": _trees_alive()}
        elif phase == "others_freed":
            for bs in sizes:
                for name in arm.others:
                    methods[bs].pop(name, None)
            for name in [n for n in runners if n != TC]:
                runners.pop(name).cleanup()
            gc.collect()
            if on_cuda:
                torch.cuda.empty_cache()
        time_phase(phase)
    out["timing_s"] = round(time.perf_counter() - t_time, 1)
    if tc_backend is not None:
        out["tc"] = {
            "dynamo_compiles": getattr(tc_backend, "dynamo_compiles", None),
            "piece_calls": tc_backend.piece_calls() if callable(getattr(tc_backend, "piece_calls", None)) else None,
            "direct_replay": {str(k): v is not None for k, v in (getattr(tc_backend, "_direct", None) or {}).items()},
        }
    probe("final")
    save()
    return 0


# -- the parent: waves, turns, the tables -------------------------------------------------------


#: Seconds past the parent's deadline a child leaves on its own (the parent kills it at
#: the deadline; this is for a parent that could not).
CHILD_GRACE_S = 15.0


class Child:
    def __init__(self, name: str, args: argparse.Namespace, sync_dir: str, deadline: float) -> None:
        self.name = name
        self.sync_dir = sync_dir
        self.json = os.path.join(args.out, "arms", f"{name}.json")
        self.log = os.path.join(args.out, "arms", f"{name}.log")
        # An earlier run into the same --out left its JSON here: a child killed or failing
        # before its first save must report nothing, not that run's cells.
        for stale in (self.json, self.json + ".tmp"):
            try:
                os.remove(stale)
            except FileNotFoundError:
                pass
        env = dict(os.environ)
        if ARMS[name].fresh_cache:
            fresh = tempfile.mkdtemp(prefix="isolation-ab-cache-")
            env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(fresh, "inductor")
            env["TRITON_CACHE_DIR"] = os.path.join(fresh, "triton")
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--child", name,
            "--json", self.json,
            "--sync-dir", sync_dir,
            "--device", args.device,
            "--model", args.model,
            "--batch-sizes", *[str(b) for b in args.batch_sizes],
            "--rounds", str(args.rounds),
            "--iters", str(args.iters),
            "--warmup-max", str(args.warmup_max),
            "--warmup-min-s", str(args.warmup_min_s),
            "--prompt-len", str(args.prompt_len),
            "--deadline", repr(deadline + CHILD_GRACE_S),
            "--parent-pid", str(os.getpid()),
        ]  # fmt: skip
        self.started = time.time()
        self.logf = open(self.log, "w")
        # A session of its own: the kill at the deadline takes the compile workers too.
        self.proc = subprocess.Popen(cmd, stdout=self.logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.status = "running"

    def ready(self) -> bool:
        return os.path.exists(os.path.join(self.sync_dir, self.name + ".ready"))

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
            return scrub("".join(f.readlines()[-8:]))


def run_wave(
    names: List[str],
    reserves: Dict[str, float],
    args: argparse.Namespace,
    sync_dir: str,
    deadline: float,
    spawned: Optional[List[Child]] = None,
) -> Dict[str, Any]:
    """Build ``names`` in parallel, then time them one at a time; ``{name: result}``.
    Each child started is appended to ``spawned`` as it starts (the caller kills what is
    left of them however this returns)."""
    children: List[Child] = []
    for n in names:
        children.append(Child(n, args, sync_dir, deadline))
        if spawned is not None:
            spawned.append(children[-1])
    # Build until each is ready or gone, or only the timing reserve is left.
    build_deadline = deadline - sum(reserves[n] for n in names)
    while any(c.proc.poll() is None and not c.ready() for c in children) and time.time() < build_deadline:
        time.sleep(0.2)
    for c in children:
        if c.proc.poll() is not None and not c.ready():
            c.status = f"exited {c.proc.returncode} while building"
        elif not c.ready():
            c.kill("killed: not built in time")
    for c in children:
        if c.status != "running":
            continue
        open(os.path.join(sync_dir, c.name + ".go"), "w").close()
        try:
            c.proc.wait(timeout=max(1.0, deadline - time.time()))
            c.status = "done" if c.proc.returncode == 0 else f"exited {c.proc.returncode} while timing"
        except subprocess.TimeoutExpired:
            c.kill("killed: not timed in time")
    results: Dict[str, Any] = {}
    for c in children:
        c.logf.close()
        entry: Dict[str, Any] = {"status": c.status, "wall_s": round(time.time() - c.started, 1)}
        if os.path.exists(c.json):  # partial when the child died while timing
            with open(c.json) as f:
                entry.update(json.load(f))
        if c.status != "done":
            entry["log_tail"] = c.tail()
        results[c.name] = entry
        print(f"{c.name}: {c.status} ({entry['wall_s']} s)", flush=True)
    return results


def plan_wave_2(
    rest: List[str], wave1: Dict[str, Any], left_s: float, default_reserve_s: float
) -> Tuple[List[str], Dict[str, float], Dict[str, str]]:
    """Which of ``rest`` fit in ``left_s`` seconds, judged by wave 1's results.

    A child's build is estimated by wave 1's: the same for a cold one, half of it on the
    warm cache; alone's for an arm without others, ``beside_both``'s (or the largest) for
    the rest. Its timing reserve is its phase count times wave 1's seconds per phase (or
    ``default_reserve_s`` per child). Children build in parallel and time in turn: an arm
    fits when the largest build plus all reserves plus a start margin fit.

    Returns:
        (arms to run, {arm: timing reserve s}, {arm skipped: why}).
    """
    builds = {n: r.get("build_total_s") for n, r in wave1.items() if r.get("build_total_s")}
    per_phase = [
        r["timing_s"] / max(1, len(r.get("phases") or {})) for r in wave1.values() if r.get("timing_s") is not None
    ]
    phase_s = max(per_phase) if per_phase else None
    worst = max(builds.values()) if builds else left_s / 2  # nothing built: assume the worst
    chosen: List[str] = []
    reserves: Dict[str, float] = {}
    skipped: Dict[str, str] = {}
    max_build = 0.0
    for name in rest:
        arm = ARMS[name]
        base = builds.get("alone", worst) if not arm.others else builds.get("beside_both", worst)
        build = base if arm.cold() else 0.5 * base
        reserve = len(arm.phases()) * phase_s + 5 if phase_s is not None else default_reserve_s
        need = max(max_build, build) + sum(reserves.values()) + reserve + 15
        if need < left_s:
            chosen.append(name)
            reserves[name] = reserve
            max_build = max(max_build, build)
        else:
            skipped[name] = f"skipped: {need:.0f} s needed, {left_s:.0f} s left"
    return chosen, reserves, skipped


def _ratio(row: Optional[Dict[str, Any]]) -> str:
    s = (row or {}).get("ratio_tc_hand")
    return f"{s['median']:.3f} [{s['lo']:.3f}-{s['hi']:.3f}]" if s else "-"


def tables(results: Dict[str, Any], sizes: List[int]) -> str:
    """The ratio table (arm x phase by size) and the probe table (one row per arm)."""
    head = " | ".join(f"bs={bs} tc/hand [lo-hi] (tc/hand ms)" for bs in sizes)
    lines = [f"| arm | phase | {head} | steady |", "|---|---|" + "---|" * len(sizes) + "---|"]
    for name, r in results.items():
        if r.get("status") != "done":
            lines.append(f"| {name} | {r.get('status')} |" + " |" * len(sizes) + " |")
        for phase, p in (r.get("phases") or {}).items():
            cells: List[str] = []
            steady: Optional[bool] = None  # None: nothing measured (a phase that failed)
            for bs in sizes:
                row = (p.get("by_bs") or {}).get(str(bs))
                if not row:
                    cells.append("-")
                    continue
                measured = [v for v in row.values() if isinstance(v, dict) and "median_ms" in v]
                if measured:
                    steady = (steady is not False) and all(v.get("steady", True) for v in measured)
                cells.append(f"{_ratio(row)} ({row[TC]['median_ms']:.3f}/{row['hand_graph']['median_ms']:.3f})")
            mark = "-" if steady is None else "yes" if steady else "no"
            lines.append(f"| {name} | {phase} | " + " | ".join(cells) + f" | {mark} |")
    lines += [
        "",
        "| arm | build s | unique graphs (others/+tc) | frames ok | recompile-limit hits | limit graph breaks | "
        "cache entries after tc | limits | inductor config changed | trees alive (others/tc) | "
        "threads | host probe us (others/tc) | tc compiles | direct replay |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "after_tc" not in r:
            continue
        a, t = r.get("after_others", {}), r.get("after_tc", {})

        def c(x: Dict[str, Any], group: str, key: str) -> Any:
            return (x.get("counters", {}).get(group) or {}).get(key)

        hits = t.get("recompile_limit_hits") or {}
        direct = (r.get("tc") or {}).get("direct_replay") or {}
        entries = {k: v for k, v in (t.get("cache_entries") or {}).items() if not k.endswith("_error")}
        changed = sorted(r.get("inductor_config_changed_by_others") or {})
        lines.append(
            f"| {name} | {r.get('build_total_s')} | {c(a, 'stats', 'unique_graphs')}/{c(t, 'stats', 'unique_graphs')} | "
            f"{c(t, 'frames', 'ok')} | {sum(hits.values())} {dict(hits) if hits else ''} | "
            f"{c(t, 'graph_break', 'recompile_limit') or 0} | {entries} | {t.get('recompile_limits')} | "
            f"{changed or 'none'} | {a.get('cudagraph_trees_alive')}/{t.get('cudagraph_trees_alive')} | "
            f"{t.get('threads')} | {a.get('host_probe_us')}/{t.get('host_probe_us')} | "
            f"{(r.get('tc') or {}).get('dynamo_compiles')} | {sum(direct.values())}/{len(direct)} |"
        )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"), help="output folder")
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu: a smoke of the harness (well under a minute), with the smaller defaults marked 'cpu:' below",
    )
    parser.add_argument("--model", default=None, help=f"preset ({_default('model')})")
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=None, help=f"decode batch sizes ({_default('batch_sizes')})"
    )
    parser.add_argument(
        "--arms", nargs="+", choices=list(ARMS), default=None, help=f"in priority order ({_default('arms')})"
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help=f"measured rounds per size and phase ({_default('rounds')})"
    )
    parser.add_argument("--iters", type=int, default=None, help=f"calls per timed block ({_default('iters')})")
    parser.add_argument("--warmup-max", type=int, default=None, help=f"most warm-up rounds ({_default('warmup_max')})")
    parser.add_argument(
        "--warmup-min-s", type=float, default=None, help=f"least warm-up seconds ({_default('warmup_min_s')})"
    )
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument(
        "--budget-s", type=float, default=None, help=f"wall-clock seconds for everything ({_default('budget_s')})"
    )
    parser.add_argument(
        "--timing-reserve-s",
        type=float,
        default=None,
        help=f"timing seconds per child in wave 1 ({_default('timing_reserve_s')})",
    )
    parser.add_argument("--child", choices=list(ARMS), help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--sync-dir", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)  # a child's: epoch seconds
    parser.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)  # a child's: leave when it is gone
    args = resolve_defaults(parser.parse_args(argv))
    if args.rounds < 1 or args.iters < 1:
        parser.error(f"--rounds and --iters must be >= 1, got {args.rounds} and {args.iters}")
    for flag, value in (("--budget-s", args.budget_s), ("--timing-reserve-s", args.timing_reserve_s)):
        if not (math.isfinite(value) and value > 0):  # NaN fails every comparison: refuse it explicitly
            parser.error(f"{flag} {value}: accepted a finite number of seconds > 0")
    bad = [b for b in args.batch_sizes if not 1 <= b <= MAX_BS]
    if bad:
        parser.error(f"--batch-sizes {' '.join(map(str, bad))}: accepted 1 to {MAX_BS} (the runners' max_bs)")
    if args.warmup_max < WARMUP_MIN:
        parser.error(f"--warmup-max {args.warmup_max}: accepted an integer >= {WARMUP_MIN} (the least warm-up rounds)")
    if not (math.isfinite(args.warmup_min_s) and args.warmup_min_s >= 0):
        parser.error(f"--warmup-min-s {args.warmup_min_s}: accepted a finite number of seconds >= 0")
    if args.prompt_len < 1:
        parser.error(f"--prompt-len {args.prompt_len}: accepted an integer >= 1")
    from cuda_graph_runner.reference.model import PRESETS

    if args.model not in PRESETS:
        parser.error(f"--model {args.model!r}: accepted a reference preset: {', '.join(sorted(PRESETS))}")
    if args.child:
        return child(args)
    spawned: List[Child] = []
    previous: Dict[int, Any] = {}

    def on_signal(signum: int, frame: Any) -> None:
        for sig in previous:  # a second signal must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        raise SystemExit(128 + signum)  # unwinds to the finally below: the children are killed

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        return parent(args, spawned)
    finally:
        for c in spawned:
            if c.proc.poll() is None:
                c.kill("killed: the parent ended")
            if not c.logf.closed:
                c.logf.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def parent(args: argparse.Namespace, spawned: List[Child]) -> int:
    """The waves, the JSON and the tables; every child started is appended to ``spawned``."""
    start = time.time()
    deadline = start + args.budget_s
    os.makedirs(os.path.join(args.out, "arms"), exist_ok=True)
    sync_dir = tempfile.mkdtemp(prefix="isolation-ab-")
    results: Dict[str, Any] = {}
    arms = list(dict.fromkeys(args.arms))
    wave1 = [n for n in arms if ARMS[n].wave == 1]
    rest = [n for n in arms if n not in wave1]
    if wave1:
        results.update(run_wave(wave1, {n: args.timing_reserve_s for n in wave1}, args, sync_dir, deadline, spawned))
    wave2, reserves, skipped = plan_wave_2(rest, dict(results), deadline - time.time(), args.timing_reserve_s)
    results.update({n: {"status": why} for n, why in skipped.items()})
    if wave2:
        results.update(run_wave(wave2, reserves, args, sync_dir, deadline, spawned))
    results = {n: results[n] for n in arms if n in results}
    for r in results.values():
        r["notes"] = [scrub(n) for n in r.get("notes") or []]
        if r.get("inductor_cache_dir"):
            r["inductor_cache_dir"] = scrub(r["inductor_cache_dir"])
    doc = {
        "device": args.device,
        "model": args.model,
        "batch_sizes": args.batch_sizes,
        "rounds": args.rounds,
        "iters": args.iters,
        "budget_s": args.budget_s,
        "wall_s": round(time.time() - start, 1),
        "variants": results,
    }
    path = os.path.join(args.out, "isolation_ab.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    text = tables(results, sorted(args.batch_sizes))
    for name, r in results.items():
        if r.get("log_tail"):
            text += f"\n--- {name} ({r['status']}), last lines of {name}.log:\n{r['log_tail']}"
        for note in r.get("notes") or []:
            text += f"\n{name}: {note}"
    with open(os.path.join(args.out, "isolation_ab.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    print(f"wrote {path} ({doc['wall_s']} s)")
    if not any(r.get("status") == "done" for r in results.values()):
        why = "; ".join(f"{n}: {r.get('status')}" for n, r in results.items()) or "no arm ran"
        print(f"isolation_ab: no arm finished ({why}); see {os.path.join(args.out, 'arms')}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
