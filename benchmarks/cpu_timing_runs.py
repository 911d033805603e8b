"""Back-to-back ``cuda-graph-runner bench`` runs: do CPU decode timings hold from run to run?

Runs the bench N times (default 5), each in a fresh process with its default settings
(plus any arguments after ``--``), reads each run's JSON and prints, per backend and
decode batch size, the ms per step of every run and their max/min; eager is the eager
time measured next to each backend (or alone, backend ``disabled``). The target: every
max/min at most ``--target`` (1.5). A measurement, not a test: exit 0 when every run
ran, whatever the spread (the last line says whether the target was met); 1 when a run
failed (its output shown); 2 for a bad argument.

    python benchmarks/cpu_timing_runs.py
    python benchmarks/cpu_timing_runs.py --runs 5 -- --no-prefill --threads 2

The first run may compile (an empty compile cache); the runs after it load the cache.
Each run's thread count and notes (the busy note when its own rounds spread) are shown.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any, Dict, List, Sequence, Tuple

Series = Dict[Tuple[str, int], List[float]]


def decode_ms(document: Dict[str, Any]) -> Dict[Tuple[str, int], float]:
    """``{(backend, batch size): ms per step}`` of one bench JSON document's decode
    timings: each backend's median, and ``eager`` from the eager time measured next to
    a backend (the first such) or from an eager-only row."""
    out: Dict[Tuple[str, int], float] = {}
    for rec in document.get("timings") or []:
        if rec.get("phase") != "decode" or rec.get("batch_size") is None:
            continue
        bs = int(rec["batch_size"])
        if rec.get("median_ms") is not None:
            out.setdefault((str(rec["method"]), bs), float(rec["median_ms"]))
        if rec.get("eager_ms") is not None:
            out.setdefault(("eager", bs), float(rec["eager_ms"]))
    return out


def spreads(series: Series) -> Dict[Tuple[str, int], float]:
    """max/min of each key's runs (keys with a run of 0 ms or fewer than two runs left out)."""
    return {k: max(v) / min(v) for k, v in series.items() if len(v) >= 2 and min(v) > 0}


def report(series: Series, runs: int, target: float) -> List[str]:
    """The table: one line per (backend, batch size): each run's ms and max/min; then, per
    backend, its worst max/min; then the verdict."""
    lines = []
    header = f"{'backend':<16} {'batch':>5}  " + "  ".join(f"run{i + 1:>2} ms" for i in range(runs)) + "  max/min"
    lines.append(header)
    lines.append("-" * len(header))
    ratio = spreads(series)
    for key in sorted(series, key=lambda k: (k[0] != "eager", k)):
        cells = "  ".join(f"{ms:>8.3f}" for ms in series[key])
        lines.append(f"{key[0]:<16} {key[1]:>5}  {cells}  {ratio.get(key, float('nan')):>7.2f}")
    worst: Dict[str, float] = {}
    for (backend, _), r in ratio.items():
        worst[backend] = max(worst.get(backend, 0.0), r)
    lines.append("")
    for backend, r in sorted(worst.items(), key=lambda kv: (kv[0] != "eager", kv[0])):
        lines.append(
            f"{backend}: worst max/min over batch sizes {r:.2f} ({'within' if r <= target else 'ABOVE'} {target})"
        )
    met = bool(worst) and all(r <= target for r in worst.values())
    lines.append(f"target max/min <= {target}: {'met' if met else 'not met'}")
    return lines


def run_once(bench_args: Sequence[str]) -> Tuple[Dict[str, Any], float]:
    """One bench run in a fresh process (``--format json``): its document and wall seconds.

    Raises:
        RuntimeError: the run failed (its exit status and the end of its stderr).
    """
    cmd = [sys.executable, "-m", "cuda_graph_runner", "bench", "--format", "json", *bench_args]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout), wall


def main(argv: Sequence[str] = ()) -> int:
    argv = list(argv)
    extra: List[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="back-to-back bench runs (default 5, at least 2)")
    p.add_argument(
        "--target", type=float, default=1.5, help="the max/min a backend's decode ms may reach (default 1.5)"
    )
    args = p.parse_args(argv)
    if args.runs < 2:
        p.error(f"--runs {args.runs}: accepted: an integer >= 2 (a spread needs two runs)")
    if not args.target >= 1.0:
        p.error(f"--target {args.target}: accepted: a number >= 1.0")
    series: Series = {}
    for i in range(args.runs):
        try:
            doc, wall = run_once(extra)
        except RuntimeError as exc:
            print(f"run {i + 1}: {exc}", file=sys.stderr)
            return 1
        env = doc.get("env") or {}
        notes = "; ".join(doc.get("notes") or []) or "none"
        print(f"run {i + 1}: {wall:.0f} s, threads {env.get('threads', '?')}, notes: {notes}", flush=True)
        for key, ms in decode_ms(doc).items():
            series.setdefault(key, []).append(ms)
    print()
    print("\n".join(report(series, args.runs, args.target)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
