"""run.py's isolated mode: every compiled method in a fresh process, the rows merged into one run.

Why: Dynamo's code caches and recompile counts, inductor's config and on-disk cache and
reduce-overhead's CUDA-graph trees are process-wide, so a compiled method timed in one
process after other methods were compiled can be slower (or faster) than it is alone
(``benchmarks/isolation_ab.py`` measures how much and why). Isolated, each process times
its methods beside its own eager run and hand-written graph, so each ratio still pairs
rounds of one process.

The groups (:func:`groups`): ``base`` (eager, the hand-written graph and every backend
that compiles nothing: ``full``, ``breakable``), one group per compiling backend label
(``full+torch_compile``, ``tc_piecewise``, ``tc_piecewise:inductor``, any backend not known
to compile nothing) and ``reduce_overhead`` (``torch.compile(mode="reduce-overhead")``).

The merge (:func:`merge`): the timing cells of eager and the hand graph come from
``base``; each other group adds the cells, ratios, captures, diffs and replay_prepare
times of its own methods. A ratio to ``hand_graph`` is the one measured in the method's
own process. A ratio to ``reduce_overhead`` of a method outside that process is chained
through the hand graph: ``(method / hand_graph in its process) * (hand_graph /
reduce_overhead in reduce-overhead's process)``, ``lo`` and ``hi`` the products of the
``lo``\\ s and of the ``hi``\\ s (``ratio_via`` in the model's extra says so). Each group's
own reference medians are kept under ``isolated[GROUP]``.

Torch-free (tests import it without a device).
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from bench_summary import ratio_stats

BASE = "base"
REDUCE_OVERHEAD = "reduce_overhead"
#: Backends that compile nothing (no Dynamo, no inductor): they share the base process.
NO_COMPILE = ("full", "breakable")
LOCAL = ("eager", "hand_graph")
#: Per-model sections merged by method.
CELL_SECTIONS = ("decode", "prefill")
RATIO_SECTIONS = ("ratios", "prefill_ratios")
BY_NAME = ("capture", "replay_prepare_us", "max_abs_diff_vs_eager")


def compiles(label: str) -> bool:
    """Whether backend ``label`` (run.py's spelling: ``name``, ``name:tc_compiler``,
    ``name+torch_compile``) compiles anything, i.e. needs a process of its own."""
    return label not in NO_COMPILE


def groups(backends: Sequence[str], reduce_overhead: bool) -> Dict[str, List[str]]:
    """``{group: backend labels}``: ``base`` first (the backends that compile nothing), then
    one group per compiling backend, then ``reduce_overhead`` (no backend labels) when the
    run times it."""
    out: Dict[str, List[str]] = {BASE: [b for b in backends if not compiles(b)]}
    for b in backends:
        if compiles(b):
            out[b] = [b]
    if reduce_overhead:
        out[REDUCE_OVERHEAD] = []
    return out


def dir_name(group: str) -> str:
    """A folder name for ``group`` (labels hold ``:`` and ``+``)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", group)


def child_argv(argv: Sequence[str], group: str, backends: Sequence[str], out_dir: str) -> List[str]:
    """The parent's arguments with this group's overrides appended (argparse keeps an
    option's last value): its backends, reduce-overhead only in its own group, its own
    output folder, no plot, no further isolation."""
    ro: List[str] = [] if group == REDUCE_OVERHEAD else ["--reduce-overhead-bs"]
    return [
        *argv,
        "--backends", ",".join(backends),
        *ro,
        "--out", out_dir,
        "--plot", "",
        "--no-isolate",
        "--isolated-group", group,
    ]  # fmt: skip


def _own(group: str, methods: Sequence[str]) -> Optional[set]:
    """The methods whose rows ``group`` contributes; None: every row (the base group)."""
    if group == BASE:
        return None
    return set(methods) | ({REDUCE_OVERHEAD} if group == REDUCE_OVERHEAD else set())


def _chain(x: Dict[str, float], y: Dict[str, float]) -> Dict[str, float]:
    return {k: round(x[k] * y[k], 5) for k in ("median", "lo", "hi")}


def merge(parts: Sequence[Tuple[str, Sequence[str], Dict[str, Any]]]) -> Tuple[Dict[str, Any], List[str]]:
    """Merge the per-model tables of the groups' runs.

    Args:
        parts: ``(group, backend labels, view)`` per finished group, ``base`` first; ``view``
            is :func:`cuda_graph_runner.cli.results_schema.nested_view` of that group's
            ``benchmarks.json``.

    Returns:
        ``(models, notes)``: run.py's per-model tables (``Results.data["models"]``) and the
        groups' notes, each prefixed with ``[GROUP]``.
    """
    models: Dict[str, Dict[str, Any]] = {}
    notes: List[str] = []
    hand_over_ro: Dict[str, Dict[str, Dict[str, float]]] = {}  # model -> bs -> hand_graph / reduce_overhead
    for group, methods, view in parts:
        notes += [f"[{group}] {n}" for n in view.get("notes", [])]
        own = _own(group, methods)
        for name, m in view.get("models", {}).items():
            out = models.setdefault(
                name, {"decode": {}, "ratios": {}, "prefill": {}, "capture": {}, "replay_prepare_us": {}}
            )
            if own is None:  # base: the machine state, floors and rates of the run
                for key, value in m.items():
                    if key not in CELL_SECTIONS + RATIO_SECTIONS + BY_NAME + ("prefill_by_requests",):
                        out[key] = value
            sections: List[Tuple[Dict[str, Any], Dict[str, Any]]] = [
                (out.setdefault(s, {}), m.get(s) or {}) for s in CELL_SECTIONS + RATIO_SECTIONS
            ]
            for r, rows in (m.get("prefill_by_requests") or {}).items():
                sections.append((out.setdefault("prefill_by_requests", {}).setdefault(r, {}), rows))
            for dst, src in sections:
                for size, row in src.items():
                    for method, cell in row.items():
                        if own is None or method in own:
                            dst.setdefault(size, {})[method] = cell
            for key in BY_NAME:
                for method, value in (m.get(key) or {}).items():
                    base_name = method[: -len(" (prefill)")] if method.endswith(" (prefill)") else method
                    if own is None or base_name in own:
                        out.setdefault(key, {})[method] = value
            refs: Dict[str, Any] = {}
            for section in CELL_SECTIONS:
                for size, row in (m.get(section) or {}).items():
                    for method in LOCAL:
                        if isinstance(row.get(method), dict):
                            refs.setdefault(section, {}).setdefault(size, {})[method] = row[method].get("median_ms")
            out.setdefault("isolated", {})[group] = {"methods": list(methods), "references_median_ms": refs}
            if group == REDUCE_OVERHEAD:
                for size, row in (m.get("decode") or {}).items():
                    if isinstance(row.get("hand_graph"), dict) and isinstance(row.get(REDUCE_OVERHEAD), dict):
                        stats = ratio_stats(row["hand_graph"], row[REDUCE_OVERHEAD])
                        if stats:
                            hand_over_ro.setdefault(name, {})[size] = stats
    for name, sizes in hand_over_ro.items():
        ratios = models[name].setdefault("ratios", {})
        chained = False
        for size, h in sizes.items():
            for refs in (ratios.get(size) or {}).values():
                if "hand_graph" in refs and REDUCE_OVERHEAD not in refs:
                    refs[REDUCE_OVERHEAD] = _chain(refs["hand_graph"], h)
                    chained = True
        if chained:
            models[name]["ratio_via"] = {REDUCE_OVERHEAD: "hand_graph"}
    return models, notes
