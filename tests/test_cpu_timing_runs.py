"""``benchmarks/cpu_timing_runs.py`` reads each bench run's JSON and reports per-backend
decode ms max/min over the runs (the bench runs are faked here: nothing is timed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import cpu_timing_runs  # noqa: E402

from cuda_graph_runner.cli.bench.output import results_document  # noqa: E402


def _document(eager_ms, graph_ms):
    rows = [
        {"batch_size": bs, "backend": "compiled", "eager_ms": e, "graph_ms": g, "speedup": e / g}
        for bs, e, g in zip((1, 2), eager_ms, graph_ms)
    ]
    rows.append({"batch_size": 4, "backend": "disabled", "eager_ms": 9.0})
    return results_document(
        {"env": {"device": "cpu", "model": "tiny", "threads": 1}, "runners": [], "decode": rows, "prefill": []}
    )


def test_decode_ms_per_backend_and_batch_eager_from_the_paired_rows():
    got = cpu_timing_runs.decode_ms(_document([1.0, 2.0], [0.5, 0.8]))
    assert got == {("compiled", 1): 0.5, ("compiled", 2): 0.8, ("eager", 1): 1.0, ("eager", 2): 2.0, ("eager", 4): 9.0}


def test_five_runs_reported_with_each_backends_worst_max_over_min(monkeypatch, capsys):
    docs = iter([_document([1.0, 2.0], [0.5, 0.8])] * 4 + [_document([1.2, 2.0], [0.5, 4.0])])

    def run(cmd, **kwargs):
        assert cmd[1:5] == ["-m", "cuda_graph_runner", "bench", "--format"] and cmd[-1] == "--no-prefill"
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(next(docs)), stderr="")

    monkeypatch.setattr(cpu_timing_runs.subprocess, "run", run)
    assert cpu_timing_runs.main(["--", "--no-prefill"]) == 0
    out = capsys.readouterr().out
    assert out.count("threads 1, notes: none") == 5
    assert "eager: worst max/min over batch sizes 1.20 (within 1.5)" in out
    assert "compiled: worst max/min over batch sizes 5.00 (ABOVE 1.5)" in out
    assert out.rstrip().endswith("target max/min <= 1.5: not met")


def test_a_failed_run_is_shown_and_exit_1(monkeypatch, capsys):
    def run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 2, stdout="", stderr="error: --threads 0 ...")

    monkeypatch.setattr(cpu_timing_runs.subprocess, "run", run)
    assert cpu_timing_runs.main(["--runs", "2"]) == 1
    assert "exited with 2:\nerror: --threads 0" in capsys.readouterr().err
