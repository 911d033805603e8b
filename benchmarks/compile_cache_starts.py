"""Cold and warm starts of one compiling backend, each in a fresh process: the compile
cache's second-start ratio (the target: a warm start compiles in at most 25% of the cold
start's time).

Each pair: an empty cache folder, a first start (cold: everything compiles), then a
second start in a new process with the same folder (warm). Each start builds the preset,
captures the given sizes with the backend and prints one JSON line: compile seconds,
capture seconds, torch's cache counters, Dynamo's frame count and where the compile time
went (``torch._dynamo.utils.compile_times``).

    python benchmarks/compile_cache_starts.py --backend compiled --sizes 1 2 4 --pairs 3
    python benchmarks/compile_cache_starts.py --backend full+torch_compile --sizes 1 2 4 8  # CPU, fake graphs
    python benchmarks/compile_cache_starts.py --backend full+torch_compile --device cuda \\
        --dtype bfloat16 --sizes 1 2 4 8 12 16 --pairs 3

Prints one line per start and a last ``ratio`` line per pair (warm / cold compile seconds).
A first start is discarded (``--no-prime`` skips it): it compiles torch's own Python
sources to bytecode, which every later start on a machine reads from ``__pycache__``
(where torch's folder is not writable, as on the lent H200 machine, the starts share a
``PYTHONPYCACHEPREFIX`` folder instead).
Exit status 0 when every start ran (the ratio is a measurement, not a test); 2 for a
user's mistake (an unknown preset, backend, compiler or device, a backend that cannot run
on the device or compiles nothing), named in one error line; 1 when a start failed otherwise (its output shown).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple


def _start(args: argparse.Namespace) -> Dict[str, Any]:
    import torch

    from cuda_graph_runner.backend.compile_cache import cache_counters
    from cuda_graph_runner.runner import DecodeCudaGraphRunner
    from cuda_graph_runner.testing.reference_setup import reference_model

    wall = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    model = reference_model(args.model, requests=max(args.sizes), dtype=dtype, device=args.device)
    from cuda_graph_runner.cli.bench.backends import TORCH_COMPILE, label_options, parse_label

    name, compiler = parse_label(args.backend)
    decode: Dict[str, Any] = {"backend": name, "bs": list(args.sizes), **label_options(compiler, None, None)}
    backend = None
    if name == "full" and torch.device(args.device).type == "cpu":
        # compiled full's own code path on the CPU: the recording fake graph module
        # stands in for CUDA graphs (the compile pass is what is measured).
        from cuda_graph_runner.testing.fakes import FakeGraphDeviceModule
        from cuda_graph_runner_full.backend import FullCudaGraphBackend

        fake = FakeGraphDeviceModule()
        backend = FullCudaGraphBackend(
            "cpu",
            phase="decode",
            device_module=fake,
            memory_pool="pool",
            compiler="inductor" if compiler == TORCH_COMPILE else compiler,
        )
    runner = DecodeCudaGraphRunner(model, {"decode": decode}, device=args.device, backend=backend, show_progress=False)
    with torch.no_grad():
        runner.capture()
    step_ms = None
    if args.replays:
        # A warm start must replay as fast as a cold one (loaded code, same guards).
        from cuda_graph_runner.reference.batches import GreedySession, make_decode_batch, make_dummy_prompts

        with torch.no_grad():
            session = GreedySession(model, model.kv_cache)
            session.prefill(make_dummy_prompts(1, [5], model.config.vocab_size, seed=1))
            batch = make_decode_batch(model.kv_cache, session.rows, None, [t[-1] for t in session.tokens])
            runner.forward(batch)
            start = time.perf_counter()
            for _ in range(args.replays):
                runner.forward(batch)
            step_ms = (time.perf_counter() - start) * 1e3 / args.replays
            session.close()
    from torch._dynamo.utils import compile_times, counters, guard_failures

    misses = [f"{code.co_name}: {reasons}" for code, reasons in guard_failures.items()]

    return {
        "backend": args.backend,
        "compile_s": getattr(runner.backend, "compile_seconds", None),
        "capture_s": runner.capture_seconds,
        "process_s": time.perf_counter() - wall,
        "dynamo_frames": int(counters["stats"]["unique_graphs"]),
        "guard_misses": misses,
        "replay_ms_bs1": step_ms,
        **cache_counters(),
        "compile_times": compile_times(repr="str", aggregate=True),
    }


def _count(minimum: int) -> Any:
    from cuda_graph_runner.config.integers import parse_digits

    def parse(text: str) -> int:
        value = parse_digits(text)  # ASCII digits only (cuda_graph_runner.config.integers)
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= {minimum}")
        return value

    return parse


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring's examples as written, and every flag's default."""


def _device_problem(text: str) -> Optional[str]:
    """Why ``--device`` cannot run here (not a device, no such device), or None."""
    import torch

    from cuda_graph_runner.cli.bench.backends import device_problem

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as exc:
        return f"not a torch device ({exc})"
    if device.type == "meta":
        return "a meta tensor has no data to run; accepted: cpu, cuda, cuda:N"
    return device_problem(device)


def main(argv: List[str] | None = None) -> int:
    from cuda_graph_runner.backend.options import declared_reads, option_readers
    from cuda_graph_runner.config import TC_COMPILERS
    from cuda_graph_runner.reference.model import PRESETS
    from cuda_graph_runner.registry import get_registry

    p = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    p.add_argument(
        "--backend",
        default="compiled",
        help="a compiling backend, name[:tc_compiler] or name+torch_compile: compiled, full+torch_compile, ...",
    )
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="model preset")
    p.add_argument("--device", default="cpu", help="torch device")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="model dtype")
    p.add_argument("--sizes", type=_count(1), nargs="+", default=[1, 2, 4], help="decode batch sizes captured")
    p.add_argument("--pairs", type=_count(1), default=3, help="cold and warm start pairs")
    p.add_argument("--replays", type=_count(0), default=0, help="also time this many batch-1 steps after capture")
    p.add_argument(
        "--prime",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first one discarded start (Python's bytecode and the file cache warm); --no-prime: none",
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        from cuda_graph_runner.backend.errors import CudaGraphRunnerError
        from cuda_graph_runner.config import CudaGraphConfigError

        try:
            print("RESULT " + json.dumps(_start(args)), flush=True)
        except (CudaGraphRunnerError, CudaGraphConfigError) as exc:  # the user's choice cannot run here
            print(f"compile_cache_starts: {exc}", file=sys.stderr)
            return 2
        return 0
    from cuda_graph_runner.cli.bench.backends import TORCH_COMPILE, label_of, parse_label

    names = get_registry().names()
    args.backend = label_of(*parse_label(args.backend))  # today's spelling (full:inductor warns)
    name, compiler = parse_label(args.backend)
    if name not in names:
        p.error(f"--backend {args.backend!r}: unknown backend; installed: {', '.join(names)}")
    reads = declared_reads(get_registry(), name)
    option = "torch_compile" if compiler == TORCH_COMPILE else "tc_compiler"
    if compiler and compiler != TORCH_COMPILE and compiler not in TC_COMPILERS:
        p.error(f"--backend {args.backend!r}: unknown compiler {compiler!r}; accepted: {', '.join(TC_COMPILERS)}")
    if compiler and reads is not None and option not in reads:
        p.error(f"--backend {args.backend!r}: backend {name!r} takes no {option}; accepted: {name!r} alone")
    takes = reads is not None and ("tc_compiler" in reads or "torch_compile" in reads)
    if name == "disabled" or (takes and compiler in (None, "eager")):
        # A backend that takes a compiler compiles nothing without one; found out only after
        # two starts otherwise (minutes on a GPU).
        readers = option_readers(get_registry())
        p.error(
            f"--backend {args.backend!r} compiles nothing; accepted: a compiling backend (compiled, "
            + ", ".join(
                [f"{n}+torch_compile" for n in readers.get("torch_compile", [])]
                + [f"{n}:inductor" for n in readers.get("tc_compiler", [])]
            )
            + ")"
        )
    problem = _device_problem(args.device)
    if problem:
        p.error(f"--device {args.device!r}: {problem}")
    me = [sys.executable, os.path.abspath(__file__), "--child", "--backend", args.backend, "--model", args.model]
    me += ["--device", args.device, "--dtype", args.dtype, "--sizes", *map(str, args.sizes)]
    me += ["--replays", str(args.replays)]
    owned: List[str] = []  # folders made here, removed at the end whatever happens
    try:
        return _starts(args, me, dict(os.environ), owned)
    finally:
        for folder in owned:
            shutil.rmtree(folder, ignore_errors=True)


def _starts(args: argparse.Namespace, me: List[str], env_base: Dict[str, str], owned: List[str]) -> int:
    import torch

    pycache = os.path.join(os.path.dirname(torch.__file__), "__pycache__")
    if sys.flags.dont_write_bytecode or not os.access(pycache, os.W_OK):
        # Without a writable bytecode cache every start compiles torch's Python sources
        # again (seconds in the lazy torch._dynamo / torch._inductor imports, in cold and
        # warm starts alike); a user's installation keeps its .pyc files.
        env_base["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="cgr-pycache-")
        owned.append(env_base["PYTHONPYCACHEPREFIX"])
        env_base.pop("PYTHONDONTWRITEBYTECODE", None)
        why = "PYTHONDONTWRITEBYTECODE is set" if sys.flags.dont_write_bytecode else f"{pycache} is not writable"
        print(f"note: {why}; the starts keep Python's bytecode in {env_base['PYTHONPYCACHEPREFIX']}")
    if args.prime:
        # One start whose numbers are discarded: Python's bytecode and the OS file cache
        # warm, as on a machine where torch was imported before.
        with tempfile.TemporaryDirectory(prefix="cgr-cache-") as folder:
            rc, _ = _run_start(me, _cache_env(env_base, folder))
            print(f"prime start (discarded): exit {rc}", flush=True)
            if rc:
                return rc
    return _pairs(args, me, env_base)


def _run_start(me: List[str], env: Dict[str, str]) -> Tuple[int, Optional[Dict[str, Any]]]:
    """One start in a fresh process: ``(0, its JSON result)``, or the exit status after
    saying why (2: the child named a user's mistake in one line; 1: its output)."""
    proc = subprocess.run(me, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode == 2 and proc.stderr.strip():
        print(proc.stderr.strip().splitlines()[-1], file=sys.stderr)
        return 2, None
    if proc.returncode or not lines:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
        return 1, None
    return 0, json.loads(lines[-1][len("RESULT ") :])


def _cache_env(env_base: Dict[str, str], folder: str) -> Dict[str, str]:
    """The environment of a start whose every cache lives in ``folder`` (empty: cold)."""
    env = dict(env_base, CUDA_GRAPH_RUNNER_CACHE_DIR=folder)
    # torch's own default folder must not serve as a second, unscoped cache
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(folder, "torch-default")
    env["TRITON_CACHE_DIR"] = os.path.join(folder, "triton")  # each pair's cold start is cold
    return env


def _pairs(args: argparse.Namespace, me: List[str], env_base: Dict[str, str]) -> int:
    ratios = []
    for pair in range(args.pairs):
        with tempfile.TemporaryDirectory(prefix="cgr-cache-") as folder:
            env = _cache_env(env_base, folder)
            seconds = []
            for which in ("cold", "warm"):
                rc, result = _run_start(me, env)
                if result is None:
                    return rc
                times = result.pop("compile_times")
                print(f"pair {pair + 1} {which}: " + json.dumps(result), flush=True)
                print(f"  compile_times: {times}", flush=True)
                compile_s = result["compile_s"]
                if compile_s is None or (which == "cold" and compile_s <= 0):
                    print(
                        f"backend {args.backend!r} compiled nothing (compile seconds {compile_s}): "
                        "no ratio; give a compiling backend: compiled, full+torch_compile, tc_piecewise:inductor",
                        file=sys.stderr,
                    )
                    return 2
                seconds.append(result["compile_s"])
            print(
                f"ratio pair {pair + 1}: warm/cold compile = {seconds[1]:.2f}/{seconds[0]:.2f} s = "
                f"{seconds[1] / seconds[0]:.0%}",
                flush=True,
            )
            ratios.append(seconds[1] / seconds[0])
    if ratios:
        print(f"median warm/cold compile over {len(ratios)} pair(s): {statistics.median(ratios):.0%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
