#!/usr/bin/env python3
"""Compare a benchmark run with the stored baseline, by ratios measured inside each run.

Usage::

    python benchmarks/compare.py NEW.json [--baseline benchmarks/baseline/h200-llama-3.2-1b.json]
                                 [--threshold 0.10] [--allow-other-gpu]

What is compared: for every model, batch size (and prefill token count), backend and
reference, the ratio ``backend time / reference time`` that ``run.py`` stored under
``ratios`` (references: ``hand_graph``, the hand-written CUDA graph, and
``reduce_overhead``, ``torch.compile(mode="reduce-overhead")``, where the run has them).
Never absolute times (they follow the machine's clocks and load) and never eager (it is
bound by the host's launch rate and moved 2x between runs of the same commit).

The rule (``judge``): a ratio is a REGRESSION when both

* its median is more than ``threshold`` (default 10%) above the baseline's median, and
* the new run's range lies wholly above the baseline's range (new ``lo`` > baseline ``hi``;
  ``lo``/``hi`` are the min/max of the per-round ratios of the run, see
  ``bench_summary.ratio_stats``),

so a change inside the noise both runs showed passes, and a slow-down larger than the
threshold that the spread cannot explain fails. A ratio present in the baseline and missing
from the new run (the backend failed or was not run) is MISSING and fails too. A median
more than ``threshold`` worse whose range overlaps the baseline's is reported as ``noisy``
(passes, but rerun: one of the two runs was noisy); one more than ``threshold`` better as
``better`` (consider refreshing the baseline).

Exit status: 0 no regression, 1 a regression or a missing ratio, 2 the inputs cannot be
compared (placeholder baseline, unreadable file, other GPU, old schema): the message says
which and what to do.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_summary import format_ratio  # noqa: E402

from cuda_graph_runner.cli.results_schema import ResultsSchemaError, from_json, nested_view  # noqa: E402
from cuda_graph_runner.cli.tables import markdown_table  # noqa: E402

DEFAULT_BASELINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "baseline", "h200-llama-3.2-1b.json")
CREATE_BASELINE = (
    "python benchmarks/run.py --out OUT --models llama-3.2-1b --batch-sizes 1 32 128 "
    "--backends full,tc_piecewise:inductor,breakable --quick --prefill-tokens && "
    "cp OUT/benchmarks.json benchmarks/baseline/h200-llama-3.2-1b.json  (on the H200, see docs/benchmarks.md)"
)
SECTIONS = (("decode", "ratios"), ("prefill", "prefill_ratios"))


class CompareError(Exception):
    """The two runs cannot be compared; the message says why and what to do."""


@dataclass
class Row:
    """One compared ratio. ``verdict``: ok, better, noisy, REGRESSION, MISSING, new."""

    model: str
    section: str
    size: str
    method: str
    ref: str
    base: Optional[Dict[str, float]]
    new: Optional[Dict[str, float]]
    verdict: str

    @property
    def change(self) -> Optional[float]:
        if not self.base or not self.new:
            return None
        return self.new["median"] / self.base["median"] - 1.0

    @property
    def failed(self) -> bool:
        return self.verdict in ("REGRESSION", "MISSING")


def judge(base: Dict[str, float], new: Dict[str, float], threshold: float) -> str:
    """Verdict for one ratio (see the module docstring): REGRESSION, noisy, better or ok.

    Args:
        base, new: ``{"median", "lo", "hi"}`` (ratio to a reference, lower is faster).
        threshold: relative slow-down tolerated, e.g. 0.10.
    """
    if new["median"] > base["median"] * (1.0 + threshold):
        return "REGRESSION" if new["lo"] > base["hi"] else "noisy"
    if new["median"] < base["median"] / (1.0 + threshold):
        return "better"
    return "ok"


def load(path: str, role: str) -> Dict[str, Any]:
    """Read a run's JSON (:mod:`cuda_graph_runner.cli.results_schema`, validated) as per-model tables
    (:func:`~cuda_graph_runner.cli.results_schema.nested_view`); :class:`CompareError` naming
    the file when it is missing, not JSON, a placeholder, not a results document (the
    bad field named), or without ratios."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        extra = f"\ncreate it with: {CREATE_BASELINE}" if role == "baseline" else ""
        raise CompareError(f"{role} {path}: no such file{extra}") from None
    except (OSError, ValueError) as exc:
        raise CompareError(f"{role} {path}: cannot read it as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CompareError(f"{role} {path}: expected a JSON object from benchmarks/run.py")
    if data.get("placeholder"):
        raise CompareError(
            f"{role} {path} is a placeholder without device numbers; create it on the H200 with:\n  {CREATE_BASELINE}"
        )
    try:
        # The shared results schema, as per-model tables.
        data = nested_view(from_json(data, f"{role} {path}"))
    except ResultsSchemaError as exc:
        raise CompareError(f"{exc}; rerun the benchmark (benchmarks/run.py) to write a results file") from None
    if not any(m.get(r) for m in data.get("models", {}).values() for _, r in SECTIONS):
        raise CompareError(
            f"{role} {path} has no ratios (did the run measure hand_graph or reduce_overhead next to a backend?)"
        )
    return data


#: Backend labels renamed since a results file was written: old -> today's spelling, so
#: results from before and after the rename compare (``cuda_graph_runner.cli.bench.backends``).
RENAMED_LABELS = {"full:inductor": "full+torch_compile"}


def _ratios(data: Dict[str, Any]) -> Iterator[Tuple[Tuple[str, str, str, str, str], Dict[str, float]]]:
    for model, m in data.get("models", {}).items():
        for section, key in SECTIONS:
            for size, methods in (m.get(key) or {}).items():
                for method, refs in methods.items():
                    for ref, stats in refs.items():
                        method, ref = RENAMED_LABELS.get(method, method), RENAMED_LABELS.get(ref, ref)
                        yield (model, section, size, method, ref), stats


def compare(
    baseline: Dict[str, Any], new: Dict[str, Any], *, threshold: float = 0.10, allow_other_gpu: bool = False
) -> List[Row]:
    """One :class:`Row` per ratio of the baseline (and per ratio only the new run has).

    Raises:
        CompareError: the runs come from different GPUs (unless ``allow_other_gpu``) or
            device types, or ``threshold`` is not in (0, 1).
    """
    if not 0 < threshold < 1:
        raise CompareError(f"--threshold {threshold}: expected a fraction in (0, 1), e.g. 0.10")
    benv, nenv = baseline.get("env", {}), new.get("env", {})
    if benv.get("device", "cuda") != nenv.get("device", "cuda"):
        raise CompareError(f"baseline ran on {benv.get('device')!r}, the new run on {nenv.get('device')!r}")
    if benv.get("gpu") != nenv.get("gpu") and not allow_other_gpu:
        raise CompareError(
            f"baseline GPU {benv.get('gpu')!r}, new run GPU {nenv.get('gpu')!r}: ratios to a "
            "reference still depend on the GPU; use a baseline of this GPU or --allow-other-gpu"
        )
    new_ratios = dict(_ratios(new))
    rows = []
    for key, base in _ratios(baseline):
        got = new_ratios.pop(key, None)
        verdict = "MISSING" if got is None else judge(base, got, threshold)
        rows.append(Row(*key, base=base, new=got, verdict=verdict))
    rows += [Row(*key, base=None, new=got, verdict="new") for key, got in new_ratios.items()]
    return rows


def table(rows: Sequence[Row]) -> str:
    """Markdown table of the rows (ratio median [lo-hi], change of the median, verdict)."""
    key = lambda r: (r.model, r.section, int(r.size) if r.size.isdigit() else r.size, r.method, r.ref)  # noqa: E731
    cells = [
        [
            r.model,
            r.section,
            r.size,
            r.method,
            r.ref,
            format_ratio(r.base),
            format_ratio(r.new),
            "-" if r.change is None else f"{r.change * 100:+.1f}%",
            r.verdict,
        ]
        for r in sorted(rows, key=key)
    ]
    return markdown_table(["model", "section", "size", "backend", "vs", "baseline", "new", "change", "verdict"], cells)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("new", help="benchmarks.json of the run to check (benchmarks/run.py --out DIR)")
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, help=f"stored run (default {DEFAULT_BASELINE})")
    parser.add_argument("--threshold", type=float, default=0.10, help="tolerated slow-down of a ratio (default 0.10)")
    parser.add_argument("--allow-other-gpu", action="store_true", help="compare runs of different GPUs")
    args = parser.parse_args(argv)
    try:
        baseline = load(args.baseline, "baseline")
        new = load(args.new, "new run")
        rows = compare(baseline, new, threshold=args.threshold, allow_other_gpu=args.allow_other_gpu)
    except CompareError as exc:
        print(f"compare: {exc}", file=sys.stderr)
        return 2
    print(table(rows))
    failed = [r for r in rows if r.failed]
    noisy = [r for r in rows if r.verdict == "noisy"]
    print()
    if noisy:
        print(
            f"{len(noisy)} ratio(s) more than {args.threshold:.0%} worse but inside the runs' spread: rerun to be sure."
        )
    if failed:
        print(
            f"FAIL: {len(failed)} ratio(s) regressed by more than {args.threshold:.0%} beyond the spread, or are missing."
        )
        return 1
    print(f"OK: no ratio regressed by more than {args.threshold:.0%} beyond the spread ({len(rows)} compared).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
