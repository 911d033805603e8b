"""``benchmarks/eager_first.py``'s arithmetic: tokens served by a time, the targets' ratios
from three starts' timelines, the seeded traffic, and the timeline plot (with matplotlib)."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import eager_first  # noqa: E402


def _start(mode, capture_ms, rows, full_speed_ms=None, first_replay_ms=None):
    timeline = [
        {"step": i, "bs": bs, "end_ms": end, "step_ms": ms, "capture_ms": cap, "ready": ready}
        for i, (bs, end, ms, cap, ready) in enumerate(rows)
    ]
    return {
        "mode": mode,
        "capture_call_ms": capture_ms,
        "first_step_ms": timeline[0]["end_ms"],
        "first_replay_ms": first_replay_ms,
        "full_speed_ms": full_speed_ms if full_speed_ms is not None else capture_ms,
        "pool_mib": None,
        "timeline": timeline,
    }


def test_summary_ratios_from_three_timelines():
    starts = {
        # blocking: 1000 ms of capture, then its first token at 1001 ms
        "blocking": _start("blocking", 1000.0, [(4, 1001.0, 1.0, 0.0, 3), (4, 1002.0, 1.0, 0.0, 3)]),
        # eager_first: tokens at 10, 40, 900 ms and 1200 ms; every size replaying at 1300 ms
        "eager_first": _start(
            "eager_first",
            0.1,
            [(2, 10.0, 10.0, 20.0, 1), (3, 40.0, 10.0, 20.0, 2), (5, 900.0, 2.0, 20.0, 2), (8, 1200.0, 2.0, 20.0, 3)],
            full_speed_ms=1300.0,
            first_replay_ms=40.0,
        ),
        "eager": _start("eager", 0.05, [(2, 9.0, 9.0, 0.0, 0), (3, 19.0, 10.0, 0.0, 0), (5, 30.0, 11.0, 0.0, 0)]),
    }
    result = eager_first.summary(starts)
    assert result["first_step_ratio"] == pytest.approx(10.0 / 9.0)
    assert result["full_speed_ratio"] == pytest.approx(1.3)
    assert result["tokens_by_blocking_first"] == {"eager_first": 10, "eager": 10}
    assert result["tokens_ratio"] == pytest.approx(1.0)
    assert eager_first.tokens_by(starts["eager_first"]["timeline"], 40.0) == 5


def test_traffic_is_seeded_and_draws_small_sizes_more_often():
    sizes = eager_first.traffic([1, 8, 64], 3000, seed=3)
    assert sizes == eager_first.traffic([64, 8, 1], 3000, seed=3)
    assert sizes.count(1) > sizes.count(8) > sizes.count(64) > 0


def test_plot_draws_the_timeline(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (extra [plot])")
    rows = [(2, 10.0 * (i + 1), 1.0, 0.5, min(i, 3)) for i in range(5)]
    starts = {mode: _start(mode, 1.0, rows) for mode in ("blocking", "eager_first", "eager")}
    path = eager_first.plot(starts, str(tmp_path / "t.png"), 5, "tiny")
    assert os.path.getsize(path) > 1000
