"""CPU smoke run of benchmarks/mixed.py (emulated graphs, the tiny preset, a small step):
the script captures every method's graphs, checks that each replays, and writes ratios
that follow from its own samples. No timing is asserted."""

from __future__ import annotations

import json
import os
import statistics
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

pytest.importorskip("cuda_graph_runner_breakable.emulation")
pytest.importorskip("cuda_graph_runner_full.backend")

import mixed  # noqa: E402


def test_cpu_smoke_run_writes_methods_and_ratios(tmp_path, capsys):
    out = tmp_path / "mixed.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--chunk", "12", "--decodes", "3", "--prefix", "4"]
    assert mixed.main([*argv, "--iters", "1", "--repeats", "2", "--warmup", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["methods"]) == set(mixed.METHODS)
    assert result["step"] == {"chunk_tokens": 12, "decodes": 3, "prefix_tokens": 4}
    full, separate = result["methods"]["mixed_full"]["samples_ms"], result["methods"]["separate"]["samples_ms"]
    assert len(full) == len(separate) == 2 and min(full + separate) > 0
    ratio = result["ratios"]["mixed_full/separate"]
    assert ratio["median"] == pytest.approx(statistics.median(a / b for a, b in zip(full, separate)))
    assert result["target_met"] == (ratio["median"] <= mixed.TARGET)
    assert "mixed_full/separate" in capsys.readouterr().out


def test_bad_counts_are_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        mixed.main(["--device", "cpu", "--decodes", "0"])
    assert "--decodes 0: must be >= 1" in capsys.readouterr().err
