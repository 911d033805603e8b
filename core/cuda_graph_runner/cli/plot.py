"""One plotter for ``cuda-graph-runner bench --plot`` and ``benchmarks/run.py --plot``.

Two panels in one PNG: decode ms per step against batch size (one line per method, eager
included), and prefill ms against tokens. Both tools write the one results schema
(:mod:`cuda_graph_runner.cli.results_schema`), read here through :func:`series_from_results`
(older documents of either tool are converted on read).

matplotlib is an optional dependency (``pip install 'cuda-graph-runner[plot]'``); it is
imported only when a picture is drawn, with the Agg backend (no display needed).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

from ..config.exceptions import CudaGraphRunnerError

#: ``{phase: {label: [(x, ms), ...]}}``; x is the batch size (decode) or tokens (prefill).
Series = Dict[str, Dict[str, List[Tuple[int, float]]]]

MARKERS = ("s", "^", "v", "D", "x", "P", "*", "<", ">")
PLOT_INSTALL_HINT = "bench --plot needs matplotlib: pip install 'cuda-graph-runner[plot]'"


class PlotUnavailableError(CudaGraphRunnerError, RuntimeError):
    """matplotlib is not installed (the message says what to install)."""


def check_plot_available() -> None:
    """Raise :class:`PlotUnavailableError` when matplotlib cannot be imported (checked
    before a bench, not after minutes of capture and timing)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise PlotUnavailableError(f"{PLOT_INSTALL_HINT} ({exc})") from None


def plot_format_problem(path: str) -> Optional[str]:
    """Why matplotlib cannot draw into ``path``, or None: its extension (none: PNG) must be a
    format matplotlib writes here (``png``, ``svg``, ``pdf``, ...). Needs matplotlib."""
    from matplotlib.figure import Figure

    ext = os.path.splitext(path)[1].lstrip(".").lower()
    supported = Figure().canvas.get_supported_filetypes()
    if ext and ext not in supported:
        return f"--plot {path!r}: matplotlib cannot write .{ext} files; accepted: a file ending in .{', .'.join(sorted(supported))}"
    return None


def _add(series: Series, phase: str, label: str, x: int, ms: Optional[float]) -> None:
    if ms is not None:
        series.setdefault(phase, {}).setdefault(label, []).append((int(x), float(ms)))


def series_from_results(results: Dict[str, Any], model: Optional[str] = None) -> Series:
    """The points to draw from a results document (either tool).

    Each timing's ``median_ms`` is a point of its method. Eager appears once per x: an
    ``eager`` timing, else the ``eager_ms`` measured next to the first backend at that x.
    Prefill timings with several request counts keep the fewest requests, so one x has
    one point. ``model`` picks a model (default: the first one timed).

    Raises:
        ResultsSchemaError: (a ``ValueError``) the dict is not a results document; the
            message names the bad field.
    """
    from .results_schema import from_json

    doc = from_json(results, "the results to plot")
    timings = doc["timings"]
    if model is None and timings:
        model = timings[0]["model"]
    timings = [t for t in timings if t["model"] == model]
    fewest: Dict[int, int] = {}
    for t in timings:
        if t["phase"] == "prefill" and t.get("requests") is not None:
            fewest[t["num_tokens"]] = min(fewest.get(t["num_tokens"], t["requests"]), t["requests"])
    series: Series = {}
    eager_from_pairs = []
    for t in timings:
        phase = t["phase"]
        x = t["batch_size"] if phase == "decode" else t["num_tokens"]
        if phase == "prefill" and t.get("requests") is not None and t["requests"] != fewest[x]:
            continue
        _add(series, phase, t["method"], x, t.get("median_ms"))
        if t["method"] != "eager" and t.get("eager_ms") is not None:
            eager_from_pairs.append((phase, x, t["eager_ms"]))
    for phase, x, ms in eager_from_pairs:
        if not any(px == x for px, _ in series.get(phase, {}).get("eager", [])):
            _add(series, phase, "eager", x, ms)
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
        from .results_schema import from_json

        doc = from_json(results, "the results to plot")
        env = doc["env"]
        models = list(dict.fromkeys(t["model"] for t in doc["timings"]))
        parts = [
            env.get("model") or (models[0] if models else None),
            env.get("device_name") or env.get("device"),
            f"torch {env['torch']}" if env.get("torch") else None,
        ]
        title = ", ".join(str(p) for p in parts if p)
    return plot_series(series_from_results(results), path, title=title)
