"""The one table formatter (``cuda_graph_runner.cli.tables``), and that every table printer uses it."""

from __future__ import annotations

import os
import sys

from cuda_graph_runner.cli import tables

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def test_text_table_aligns_numbers_right_and_words_left():
    # bools are ints, so a column of checks aligns right too
    text = tables.format_table(["name", "ms", "ok"], [["full", 1.5, True], ["breakable", None, False]])
    assert text.split("\n") == [
        "name          ms   ok",
        "---------  -----  ---",
        "full       1.500  yes",
        "breakable      -   NO",
    ]


def test_markdown_table_has_one_line_per_row_and_a_rule():
    text = tables.markdown_table(["batch", "full"], [["1", 0.25], ["32", None]])
    assert text.split("\n") == ["| batch | full |", "|---|---|", "| 1 | 0.250 |", "| 32 | - |"]


def test_format_cell():
    assert [tables.format_cell(v) for v in (None, True, False, 2, 0.5, "x")] == ["-", "yes", "NO", "2", "0.500", "x"]
    assert tables.format_cell(0.25, ".1f") == "0.2"


def test_every_table_printer_uses_the_one_module():
    from cuda_graph_runner.cli import command as cli
    from cuda_graph_runner.cli.bench import command as bench

    sys.path.insert(0, BENCH)
    try:
        import compare
        import make_docs
    finally:
        sys.path.remove(BENCH)
    assert bench.format_table is tables.format_table
    assert compare.markdown_table is tables.markdown_table and make_docs.markdown_table is tables.markdown_table
    source = open(cli.__file__).read()
    assert "from .tables import format_table" in source
