"""benchmarks/replay_prepare.py --against: two checkouts timed in alternation, each worker
importing the package of the checkout it was started for."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import replay_prepare  # noqa: E402


def test_against_a_checkout_prints_both_sides_and_their_ratio(capsys):
    assert replay_prepare.main(["--against", ROOT, "--iters", "3", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    ratios = [float(line.rsplit("B/A", 1)[1]) for line in out.splitlines() if " B/A " in line]
    names = replay_prepare.build_cases("cpu")
    assert len(ratios) == len(names)  # every case timed on both sides (the same checkout here)
    assert all(r > 0 for r in ratios)
    assert set(replay_prepare._case_names()) == set(names)


def test_against_a_folder_without_the_package_is_one_line_and_exit_2(tmp_path, capsys):
    assert replay_prepare.main(["--against", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "core/cuda_graph_runner" in err
