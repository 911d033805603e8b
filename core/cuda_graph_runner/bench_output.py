"""What ``cuda-graph-runner bench`` writes besides its tables: CSV rows."""

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
    "max_abs_diff",
)


def results_csv(results: Dict[str, Any]) -> str:
    """The decode and prefill rows of ``results`` as CSV text (header :data:`CSV_COLUMNS`;
    booleans ``true``/``false``, missing values empty)."""
    import csv
    import io

    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for phase in ("decode", "prefill"):
        for row in results.get(phase, []):
            cells = {k: ("true" if v else "false") if isinstance(v, bool) else v for k, v in row.items()}
            writer.writerow({"phase": phase, **cells})
    return out.getvalue()
