"""``bench --format``, ``--plot``, ``-v``/``--log-level`` and the hidden NumPy warning."""

from __future__ import annotations

import csv
import io
import json
import logging
import warnings

import pytest

from cuda_graph_runner.cli import logging_setup as cli_logging
from cuda_graph_runner.cli.bench.command import CSV_COLUMNS, results_csv
from cuda_graph_runner.cli.command import build_parser, main
from cuda_graph_runner.cli.results_schema import SCHEMA, from_bench_rows, from_json, from_run_models

SMALL_BENCH = (
    "bench --batch-sizes 1 2 --prefill-tokens 8 --prefill-requests 2 --iters 1 --warmup 0 --steps 1 --prompt-len 4"
    " --device cpu"
).split()


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory):
    """One small CPU bench, its stdout in --format json, its --json file and its --plot PNG."""
    folder = tmp_path_factory.mktemp("bench")
    import contextlib
    import importlib.util

    # The GPU machine's environment may lack the optional matplotlib: then no --plot here.
    plot = ["--plot", str(folder / "b.png")] if importlib.util.find_spec("matplotlib") else []
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*SMALL_BENCH, "--format", "json", "--json", str(folder / "b.json"), *plot])
    return code, out.getvalue(), err.getvalue(), folder


def test_format_json_prints_only_the_json_document(bench_json):
    code, out, err, folder = bench_json
    assert code == 0
    data = json.loads(out)  # nothing but the document on stdout
    assert data["schema"] == SCHEMA and data["tool"] == "bench"
    assert from_json(data) == data  # valid as written
    assert data == json.loads((folder / "b.json").read_text())
    decode = [t for t in data["timings"] if t["phase"] == "decode"]
    assert sorted(t["batch_size"] for t in decode) == [1, 2]
    assert all(t["median_ms"] > 0 and t["model"] == "tiny" for t in data["timings"])
    assert "model tiny" in err  # the words for people went to stderr


def test_plot_writes_a_png(bench_json):
    pytest.importorskip("matplotlib", reason="bench --plot needs the optional matplotlib (cuda-graph-runner[plot])")
    code, _, _, folder = bench_json
    png = (folder / "b.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_csv_rows_parse_with_the_documented_columns(bench_json):
    data = json.loads(bench_json[1])
    rows = list(csv.DictReader(io.StringIO(results_csv(data))))
    assert tuple(rows[0]) == CSV_COLUMNS
    decode = [r for r in rows if r["phase"] == "decode"]
    prefill = [r for r in rows if r["phase"] == "prefill"]
    assert [int(r["batch_size"]) for r in decode] == [1, 2]
    assert all(float(r["eager_ms"]) > 0 for r in rows)
    assert prefill and all(r["num_tokens"] == "8" and r["batch_size"] == "" for r in prefill)


def test_format_csv_on_stdout(capsys):
    assert main([*SMALL_BENCH, "--no-prefill", "--batch-sizes", "1", "--format", "csv"]) == 0
    out = capsys.readouterr().out
    [row] = list(csv.DictReader(io.StringIO(out)))
    assert row["phase"] == "decode" and row["batch_size"] == "1" and float(row["eager_ms"]) > 0


def test_bad_format_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--format", "xml"])
    assert info.value.code == 2
    assert "xml" in capsys.readouterr().err


def test_plot_series_of_both_tools():
    from cuda_graph_runner.cli.plot import series_from_results

    bench = from_bench_rows(
        {
            "env": {"device": "cuda", "model": "tiny"},
            "decode": [
                {"batch_size": 2, "backend": "full", "eager_ms": 3.0, "graph_ms": 1.0},
                {"batch_size": 1, "backend": "full", "eager_ms": 2.0, "graph_ms": 0.5},
            ],
            "prefill": [
                {"num_tokens": 8, "requests": 4, "backend": "full", "eager_ms": 9.0, "graph_ms": 8.0},
                {"num_tokens": 8, "requests": 1, "backend": "full", "eager_ms": 7.0, "graph_ms": 6.0},
            ],
        }
    )
    series = series_from_results(bench)
    assert series["decode"] == {"full": [(1, 0.5), (2, 1.0)], "eager": [(1, 2.0), (2, 3.0)]}
    assert series["prefill"] == {"full": [(8, 6.0)], "eager": [(8, 7.0)]}
    suite = from_run_models(
        {"tiny": {"decode": {"4": {"eager": {"median_ms": 2.0}, "full": {"median_ms": 1.0}}}, "prefill": {}}},
        {"device": "cuda"},
    )
    assert series_from_results(suite) == {"decode": {"eager": [(4, 2.0)], "full": [(4, 1.0)]}}
    with pytest.raises(ValueError, match="schema None is not accepted"):
        series_from_results({"other": 1})


def test_plot_without_matplotlib_says_what_to_install(monkeypatch, tmp_path, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    assert main([*SMALL_BENCH, "--plot", str(tmp_path / "p.png")]) == 2
    assert "pip install 'cuda-graph-runner[plot]'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,level",
    [
        ([], logging.WARNING),
        (["-v"], logging.INFO),
        (["-vv"], logging.DEBUG),
        (["--log-level", "error"], logging.ERROR),
        (["-vv", "--log-level", "WARNING"], logging.WARNING),
    ],
)
def test_verbosity_flags_map_to_levels_before_or_after_the_subcommand(argv, level):
    parser = build_parser()
    assert cli_logging.level_from_args(parser.parse_args([*argv, "backends"])) == level
    assert cli_logging.level_from_args(parser.parse_args(["backends", *argv])) == level


def test_bad_log_level_names_the_accepted_ones(capsys):
    with pytest.raises(SystemExit):
        main(["--log-level", "loud", "backends"])
    err = capsys.readouterr().err
    assert "'loud'" in err and "DEBUG, INFO, WARNING" in err


def test_verbose_shows_our_info_records_and_hides_others_below_warning():
    stream = io.StringIO()
    cli_logging.configure_logging(logging.INFO, stream=stream, roots=["cuda_graph_runner", "acme_cgr"])
    try:
        logging.getLogger("cuda_graph_runner.runner.base").info("captured 3 decode graphs")
        logging.getLogger("acme_cgr.backend").info("acme info")
        logging.getLogger("some_library").info("library chatter")
        logging.getLogger("some_library").warning("library warning")
        logging.getLogger("cuda_graph_runner.x").debug("debug hidden at INFO")
    finally:
        cli_logging.configure_logging(logging.WARNING, stream=io.StringIO(), roots=[])
    text = stream.getvalue()
    assert "captured 3 decode graphs" in text and "acme info" in text and "library warning" in text
    assert "library chatter" not in text and "debug hidden" not in text


def test_main_with_v_logs_capture_times_to_stderr(capsys, monkeypatch):
    """End to end: `-v` makes the runner's INFO record visible (it was never shown before)."""
    from cuda_graph_runner.cli.bench import command as bench

    def fake_bench(args):
        logging.getLogger("cuda_graph_runner.runner.base").info("captured 2 decode graphs with x in 0.10 s")
        return 0

    monkeypatch.setattr(bench, "run_bench", fake_bench)
    assert main(["bench", "-v"]) == 0
    assert "INFO cuda_graph_runner.runner.base: captured 2 decode graphs" in capsys.readouterr().err
    assert main(["bench"]) == 0
    assert "captured" not in capsys.readouterr().err


def test_torch_numpy_warning_is_hidden_by_the_cli():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli_logging.hide_third_party_noise()
        warnings.warn("Failed to initialize NumPy: No module named 'numpy'", UserWarning, stacklevel=1)
        warnings.warn("another warning", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["another warning"]
