#!/usr/bin/env python3
"""Breakable against full, from one ``run.py`` result: the check of its decode target.

Usage::

    python benchmarks/breakable_vs_full.py OUT/benchmarks.json [--max-ratio 1.15] [--before OLD.json]

For every model and decode batch size of the run: ``breakable / full`` (median of the
medians, and the min/max of the per-round ratios: ``run.py`` times every method once per
round, so a drift of the machine cancels in each pair; ``bench_summary.ratio_stats``).
A median above ``--max-ratio`` fails. For every prefill token count: ``breakable /
eager`` of this run and, with ``--before`` (a run of the commit before, or one with
``CUDA_GRAPH_RUNNER_BREAKABLE_INLINE_SAFE_OPS=0``), the same ratio there: prefill must be
unchanged or better (a median more than ``--prefill-slack`` above the old one whose
range lies wholly above the old range fails, the rule of ``compare.py``).

Exit status: 0 within the targets, 1 a target missed, 2 the input lacks what is
compared (no full or breakable cells: the message says which run to make).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_summary import ratio_stats  # noqa: E402

from cuda_graph_runner.cli.results_schema import nested_view, read  # noqa: E402

RUN = (
    "python benchmarks/run.py --out OUT --models llama-3.2-1b qwen2.5-0.5b --batch-sizes 1 32 128 "
    "--backends full,breakable --quick --prefill-tokens 128 512 2048"
)


def pair_ratios(section: Dict[str, Dict[str, Any]], num: str, den: str) -> Dict[str, Optional[Dict[str, float]]]:
    """``{size: ratio_stats(num, den) or None}`` over the sizes of a ``decode``/``prefill`` section."""
    out: Dict[str, Optional[Dict[str, float]]] = {}
    for size in sorted(section, key=lambda s: int(s)):
        row = section[size]
        a, b = row.get(num), row.get(den)
        out[size] = ratio_stats(a, b) if isinstance(a, dict) and isinstance(b, dict) else None
    return out


def check(run: Dict[str, Any], before: Optional[Dict[str, Any]], max_ratio: float, prefill_slack: float) -> tuple:
    """(lines, failures, missing) for the report."""
    lines: List[str] = []
    failures = missing = 0
    for model, m in sorted(run.get("models", {}).items()):
        lines.append(f"{model}: decode breakable / full (target <= {max_ratio:.2f})")
        for size, r in pair_ratios(m.get("decode", {}), "breakable", "full").items():
            if r is None:
                missing += 1
                lines.append(f"  bs {size:>4}: MISSING (no full or breakable cell)")
                continue
            ok = r["median"] <= max_ratio
            failures += not ok
            lines.append(f"  bs {size:>4}: {r['median']:.3f} [{r['lo']:.3f}-{r['hi']:.3f}] {'ok' if ok else 'OVER'}")
        prefill = m.get("prefill", {})
        if not prefill:
            continue
        old = ((before or {}).get("models", {}).get(model, {}) or {}).get("prefill", {})
        old_ratios = pair_ratios(old, "breakable", "eager") if old else {}
        lines.append(f"{model}: prefill breakable / eager" + (" (against --before)" if before else ""))
        for size, r in pair_ratios(prefill, "breakable", "eager").items():
            if r is None:
                missing += 1
                lines.append(f"  {size:>5} tokens: MISSING")
                continue
            text = f"  {size:>5} tokens: {r['median']:.3f} [{r['lo']:.3f}-{r['hi']:.3f}]"
            o = old_ratios.get(size)
            if o is not None:
                worse = r["median"] > o["median"] * (1 + prefill_slack) and r["lo"] > o["hi"]
                failures += worse
                text += f" before {o['median']:.3f} [{o['lo']:.3f}-{o['hi']:.3f}] {'WORSE' if worse else 'ok'}"
            lines.append(text)
    return lines, failures, missing


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="benchmarks.json of a run.py run with full and breakable")
    parser.add_argument("--max-ratio", type=float, default=1.15, help="decode breakable / full target (default 1.15)")
    parser.add_argument("--before", default=None, help="an earlier run's benchmarks.json, for the prefill comparison")
    parser.add_argument(
        "--prefill-slack",
        type=float,
        default=0.10,
        help="prefill may be this much slower before it counts as worse (default 0.10)",
    )
    args = parser.parse_args(argv)
    try:
        # The shared results schema (validated, older files converted), as per-model tables.
        run = nested_view(read(args.run))
        before = nested_view(read(args.before)) if args.before else None
    except (OSError, ValueError) as exc:  # ResultsSchemaError (a ValueError) names the bad field
        print(f"cannot read the input: {exc}", file=sys.stderr)
        return 2
    lines, failures, missing = check(run, before, args.max_ratio, args.prefill_slack)
    print("\n".join(lines))
    if missing or not lines:
        print(f"the run lacks full/breakable cells; make one with: {RUN}", file=sys.stderr)
        return 2
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
