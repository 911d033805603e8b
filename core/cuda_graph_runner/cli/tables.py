"""The one table formatter: fixed-width text for the terminal (``cuda-graph-runner backends``,
``bench``) and Markdown for documents (``benchmarks/compare.py``, ``benchmarks/make_docs.py``).

Both render a cell the same way (:func:`format_cell`). Standard library only, so the CLI
and the benchmark scripts use it without importing torch.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["format_cell", "format_table", "markdown_table"]


def format_cell(value: Any, spec: str = ".3f") -> str:
    """``value`` as table text: ``-`` for None, ``yes``/``NO`` for a bool (a failed check
    stands out), a float with ``spec`` (default 3 decimals), anything else with ``str``."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width text table: header, a dashed rule, one line per row.

    Columns whose every value is a number (or None) align right, others left; trailing
    spaces are stripped. Each row has one value per header.
    """
    cells = [[str(h) for h in headers]] + [[format_cell(v) for v in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [all(isinstance(r[i], (int, float)) or r[i] is None for r in rows) for i in range(len(headers))]
    lines = [
        "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)).rstrip()
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown (GitHub) table: ``| a | b |`` lines under a ``|---|---|`` rule, no padding
    (the rendered page aligns it). Cells are rendered by :func:`format_cell`; a ``|``
    inside a cell is not escaped, so callers pass cells without one."""
    lines = ["| " + " | ".join(str(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(format_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
