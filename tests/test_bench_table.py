"""The bench's tables: ``speedup`` is the printed eager ms / graph ms, the per-round spread
has a label and a unit, and a batch the runner ran eagerly says so (``replayed``)."""

from __future__ import annotations

import pytest

from cuda_graph_runner.cli.bench import measure as bench_measure
from cuda_graph_runner.cli.command import main


def _table(text: str, header_start: str):
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    headers = [h for h in lines[i].split("  ") if h.strip()]
    rows = []
    for line in lines[i + 2 :]:
        if not line.strip():
            break
        rows.append([c.strip() for c in line.split("  ") if c.strip()])
    return [h.strip() for h in headers], rows


def test_decode_table_speedup_is_the_printed_ratio_and_a_fallback_row_shows_it(capsys, monkeypatch):
    pytest.importorskip("cuda_graph_runner_compiled", reason="uses the compiled backend (cuda-graph-runner-compiled)")
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_COMPILED_COMPILER", "eager")  # no code generation: seconds
    argv = "bench --decode-backends compiled --batch-sizes 1 2 --cuda-graph-max-bs-decode 1"
    argv += " --iters 1 --warmup 0 --steps 1 --prompt-len 2 --no-prefill --device cpu"
    assert main(argv.split()) == 0
    headers, rows = _table(capsys.readouterr().out, "batch")
    assert headers[:6] == ["batch", "eager ms", "graph ms", "speedup", "per-round min-max", "replayed"]
    by_batch = {row[0]: dict(zip(headers, row)) for row in rows}
    for row in by_batch.values():
        eager, graph = float(row["eager ms"]), float(row["graph ms"])
        assert row["speedup"].endswith("x")
        assert float(row["speedup"][:-1]) == pytest.approx(eager / graph, rel=0.01, abs=0.006)
        lo, hi = (float(x) for x in row["per-round min-max"].rstrip("x").split("x-"))
        assert lo <= float(row["speedup"][:-1]) + 0.006 and hi >= float(row["speedup"][:-1]) - 0.006
    assert by_batch["1"]["replayed"] == "yes"
    assert by_batch["2"]["replayed"] == "NO"  # above the captured size 1: run eagerly


def test_paired_speedup_is_the_ratio_of_the_medians_within_the_round_spread(clock):
    eager_costs = iter([1.0, 2.0, 3.0, 4.0, 5.0])
    graph_costs = iter([1.0, 2.0, 1.0, 4.0, 1.0])

    def eager():
        clock.now += next(eager_costs)

    def graph():
        clock.now += next(graph_costs)

    got = bench_measure.paired_ms(eager, graph, iters=1, warmup=0, sync=lambda: None, rounds=5)
    assert (got["eager_ms"], got["graph_ms"]) == (3000.0, 1000.0)
    assert got["speedup"] == 3.0  # the median of the per-round ratios (1, 1, 3, 1, 5) is 1
    assert (got["speedup_lo"], got["speedup_hi"]) == (1.0, 5.0)


@pytest.fixture()
def clock(monkeypatch):
    class Clock:
        now = 0.0

    c = Clock()
    monkeypatch.setattr(bench_measure.time, "perf_counter", lambda: c.now)
    return c
