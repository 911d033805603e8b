"""One plotter for ``cuda-graph-runner bench --plot`` and ``benchmarks/run.py --plot``.

Two panels in one PNG: decode ms per step against batch size (one line per backend, eager
included), and prefill ms against tokens. Both result schemas are read through
:func:`series_from_results`, so the two tools draw the same picture from their own JSON:

* ``bench`` (``"schema": "cuda-graph-runner.bench/1"``): rows ``decode[]`` with
  ``batch_size, backend, eager_ms, graph_ms`` and ``prefill[]`` with ``num_tokens,
  requests, backend, eager_ms, graph_ms``;
* ``benchmarks/run.py`` (``"schema"`` an int): ``models[name].decode[bs][method].median_ms``
  and ``models[name].prefill[tokens][method].median_ms``.

matplotlib is an optional dependency (``pip install 'cuda-graph-runner[plot]'``); it is
imported only when a picture is drawn, with the Agg backend (no display needed).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

#: ``{phase: {label: [(x, ms), ...]}}``; x is the batch size (decode) or tokens (prefill).
Series = Dict[str, Dict[str, List[Tuple[int, float]]]]

MARKERS = ("s", "^", "v", "D", "x", "P", "*", "<", ">")
PLOT_INSTALL_HINT = "bench --plot needs matplotlib: pip install 'cuda-graph-runner[plot]'"


class PlotUnavailableError(RuntimeError):
    """matplotlib is not installed (the message says what to install)."""


def check_plot_available() -> None:
    """Raise :class:`PlotUnavailableError` when matplotlib cannot be imported (checked
    before a bench, not after minutes of capture and timing)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise PlotUnavailableError(f"{PLOT_INSTALL_HINT} ({exc})") from None


def _add(series: Series, phase: str, label: str, x: int, ms: Optional[float]) -> None:
    if ms is not None:
        series.setdefault(phase, {}).setdefault(label, []).append((int(x), float(ms)))


def series_from_results(results: Dict[str, Any], model: Optional[str] = None) -> Series:
    """The points to draw from a ``bench`` or a ``benchmarks/run.py`` result dict.

    ``bench`` rows: eager appears once per x (the first backend's eager time); prefill
    rows with several request counts keep the fewest requests, so one x has one point.
    ``model`` picks a model of a ``benchmarks/run.py`` result (default: the first).

    Raises:
        ValueError: the dict is neither schema (names the keys it has).
    """
    series: Series = {}
    if isinstance(results.get("models"), dict):  # benchmarks/run.py
        models = results["models"]
        if not models:
            return series
        data = models[model] if model is not None else next(iter(models.values()))
        for phase in ("decode", "prefill"):
            for x, methods in (data.get(phase) or {}).items():
                for label, cell in methods.items():
                    if isinstance(cell, dict):
                        _add(series, phase, label, int(x), cell.get("median_ms"))
    elif "decode" in results or "prefill" in results:  # bench
        for row in results.get("decode", []):
            _add(series, "decode", row["backend"], row["batch_size"], row.get("graph_ms"))
            if not any(x == row["batch_size"] for x, _ in series.get("decode", {}).get("eager", [])):
                _add(series, "decode", "eager", row["batch_size"], row.get("eager_ms"))
        prefill = results.get("prefill", [])
        fewest: dict[int, int] = {}
        for row in prefill:
            fewest[row["num_tokens"]] = min(fewest.get(row["num_tokens"], row["requests"]), row["requests"])
        for row in prefill:
            if row["requests"] != fewest[row["num_tokens"]]:
                continue
            _add(series, "prefill", row["backend"], row["num_tokens"], row.get("graph_ms"))
            if not any(x == row["num_tokens"] for x, _ in series.get("prefill", {}).get("eager", [])):
                _add(series, "prefill", "eager", row["num_tokens"], row.get("eager_ms"))
    else:
        raise ValueError(f"not a bench or benchmarks/run.py result: keys {sorted(results)}")
    for by_backend in series.values():
        for points in by_backend.values():
            points.sort()
    return series


def plot_series(series: Series, path: str, *, title: str = "") -> str:
    """Draw ``series`` into the PNG ``path``; returns ``path``.

    Raises:
        PlotUnavailableError: matplotlib is not installed.
        ValueError: nothing to draw.
    """
    check_plot_available()
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server or in CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    panels = [
        (phase, xlabel)
        for phase, xlabel in (("decode", "batch size (requests)"), ("prefill", "tokens per prefill batch"))
        if series.get(phase)
    ]
    if not panels:
        raise ValueError("nothing to plot: the results have no decode or prefill times")
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.6), squeeze=False)
    for ax, (phase, xlabel) in zip(axes[0], panels):
        ordered = sorted(series[phase].items(), key=lambda kv: (kv[0] != "eager", kv[0]))
        for i, (label, points) in enumerate(ordered):
            xs, ys = zip(*points)
            # Distinct hollow markers: backends within a few % of each other stay visible.
            style = (
                {"color": "black", "linestyle": "--", "marker": "o"}
                if label == "eager"
                else {"marker": MARKERS[i % len(MARKERS)], "markerfacecolor": "none", "markersize": 8}
            )
            ax.plot(xs, ys, label=label, **style)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({x for pts in series[phase].values() for x, _ in pts}))
        ax.get_xaxis().set_major_formatter(ScalarFormatter())
        ax.set_xlabel(xlabel)
        ax.set_ylabel("decode ms per step" if phase == "decode" else "prefill ms per batch (fewest requests)")
        ax.set_title(f"{phase}: lower is better")
        ax.grid(True, alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_results(results: Dict[str, Any], path: str, *, title: Optional[str] = None) -> str:
    """:func:`series_from_results` then :func:`plot_series`; the title defaults to the
    model, device and torch of ``results["env"]``."""
    if title is None:
        env = results.get("env", {})
        parts = [
            env.get("model") or ", ".join(results.get("models", {}) or []),
            env.get("device_name") or env.get("gpu") or env.get("device"),
            f"torch {env['torch']}" if env.get("torch") else None,
        ]
        title = ", ".join(str(p) for p in parts if p)
    return plot_series(series_from_results(results), path, title=title)
