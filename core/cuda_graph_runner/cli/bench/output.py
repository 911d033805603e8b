"""What ``cuda-graph-runner bench`` writes besides its tables: the results document
(:mod:`cuda_graph_runner.cli.results_schema`, ``--json PATH`` / ``--format json``) and CSV
rows (``--format csv``)."""

from __future__ import annotations

from typing import Any, Dict

#: Columns of ``--format csv``: one row per decode batch size or prefill (tokens,
#: requests) per backend; a phase leaves the other phase's columns empty.
CSV_COLUMNS = (
    "phase",
    "backend",
    "batch_size",
    "num_tokens",
    "requests",
    "eager_ms",
    "graph_ms",
    "speedup",
    "replay_prepare_us",
    "replayed",
    "tokens_match",
    "argmax_match",
    "within_tolerance",
    "max_abs_diff",
)


def results_csv(results: Dict[str, Any]) -> str:
    """A results document (:mod:`cuda_graph_runner.cli.results_schema`, any version) as CSV
    text (header :data:`CSV_COLUMNS`): one row per timing of a backend (``graph_ms`` its
    time, ``eager_ms`` the eager time measured next to it) or of eager alone (backend
    ``disabled``, ``graph_ms`` empty); booleans ``true``/``false``, missing values empty.

    Raises:
        ResultsSchemaError: ``results`` is not a results document (names the bad field).
    """
    import csv
    import io

    from ..results_schema import from_json

    doc = from_json(results, "the results for CSV")
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for phase in ("decode", "prefill"):
        for t in doc["timings"]:
            if t["phase"] != phase:
                continue
            row = dict(t)
            if t["method"] == "eager":
                row.update(backend="disabled", eager_ms=t["median_ms"])
            else:
                row.update(backend=t["method"], graph_ms=t["median_ms"])
            cells = {k: ("true" if v else "false") if isinstance(v, bool) else v for k, v in row.items()}
            writer.writerow(cells)
    return out.getvalue()


def results_document(results: Dict[str, Any]) -> Dict[str, Any]:
    """The bench's rows (``{"env", "runners", "decode", "prefill", "notes"}``) as a
    validated :data:`cuda_graph_runner.cli.results_schema.SCHEMA` document."""
    from ..results_schema import from_bench_rows

    return from_bench_rows(results)
