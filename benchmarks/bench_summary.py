"""Ratios measured inside one benchmark run, and run.py's per-model tables they live in.

Torch-free: used by ``run.py`` (writes them), ``compare.py`` (checks them against the
baseline) and ``make_docs.py`` (tables).

A ratio is ``method time / reference time`` at one batch size, both from the same run
(references: the hand-written CUDA graph and ``torch.compile(mode="reduce-overhead")``,
never eager: eager is bound by the host's launch rate and moved 2x between runs).
Because ``bench_rounds.run_rounds`` times every method once per round, each round gives a
paired ratio in which a drift of the machine cancels; the reported spread is the min and
max of those per-round ratios.

run.py builds its results as these per-model tables (``SCHEMA`` names their layout) and
writes them in the shared schema
(:mod:`cuda_graph_runner.cli.results_schema`: ``from_run_models``); readers get the tables
back with ``results_schema.nested_view``::

    {"schema": SCHEMA, "env": {...}, "settings": {...}, "notes": [...],
     "models": {MODEL: {
        "decode":  {BS: {METHOD: {"median_ms", "min_ms", "max_ms", "samples_ms", "warmup_rounds",
                                  "steady", "gc_ms"}}},
        "ratios":  {BS: {METHOD: {REF: {"median", "lo", "hi"}}}},
        "prefill": {TOKENS: {METHOD: cell}}, "prefill_ratios": {...},
        "capture": {...}, "replay_prepare_us": {...}, "max_abs_diff_vs_eager": {...}}}}

``BS``/``TOKENS`` are strings (JSON keys); times are ms per step.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

#: The tables' layout (in memory; files are written in the shared results schema).
SCHEMA = "cuda-graph-runner-benchmarks/2"
REFERENCES = ("hand_graph", "reduce_overhead")
NOT_COMPARED = ("eager",) + REFERENCES


def ratio_stats(num: Dict[str, Any], den: Dict[str, Any]) -> Optional[Dict[str, float]]:
    """``{"median", "lo", "hi"}`` of ``num / den`` for two cells of one run.

    ``median`` is the ratio of the medians; ``lo``/``hi`` the min/max of the per-round
    ratios (round ``r`` of ``num`` over round ``r`` of ``den``), or, when the rounds do not
    pair (different counts), ``min(num) / max(den)`` and ``max(num) / min(den)``.
    None when a median is missing or zero.
    """
    nm, dm = num.get("median_ms"), den.get("median_ms")
    if not nm or not dm:
        return None
    ns: List[float] = num.get("samples_ms") or []
    ds: List[float] = den.get("samples_ms") or []
    if ns and len(ns) == len(ds) and all(d > 0 for d in ds):
        paired = [n / d for n, d in zip(ns, ds)]
        lo, hi = min(paired), max(paired)
    else:
        lo, hi = num.get("min_ms", nm) / den.get("max_ms", dm), num.get("max_ms", nm) / den.get("min_ms", dm)
    med = nm / dm
    return {"median": round(med, 5), "lo": round(min(lo, med), 5), "hi": round(max(hi, med), 5)}


def ratios_for(rows: Dict[str, Dict[str, Dict[str, Any]]]) -> Dict[str, Dict[str, Dict[str, Dict[str, float]]]]:
    """Ratios of every method but eager and the references to each reference present at that size.

    Args:
        rows: ``{BS: {METHOD: cell}}`` (a model's ``decode`` or ``prefill`` section).

    Returns:
        ``{BS: {METHOD: {REF: ratio_stats}}}``; sizes or methods without a reference are left out.
    """
    out: Dict[str, Dict[str, Dict[str, Dict[str, float]]]] = {}
    for size, row in rows.items():
        for method, cell in row.items():
            if method in NOT_COMPARED or not isinstance(cell, dict):
                continue
            for ref in REFERENCES:
                if isinstance(row.get(ref), dict):
                    r = ratio_stats(cell, row[ref])
                    if r is not None:
                        out.setdefault(size, {}).setdefault(method, {})[ref] = r
    return out


def median_ms(cell: Any) -> Optional[float]:
    """The cell's median (ms); None for a cell that is not a timing object."""
    return cell.get("median_ms") if isinstance(cell, dict) else None


def format_ratio(stats: Optional[Dict[str, float]]) -> str:
    """A table cell for ``{"median", "lo", "hi"}`` (:func:`ratio_stats`): ``median [lo-hi]``
    with 3 decimals; ``-`` when there is none."""
    return "-" if not stats else f"{stats['median']:.3f} [{stats['lo']:.3f}-{stats['hi']:.3f}]"
