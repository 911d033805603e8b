"""The replay traces committed with the H200 results (``benchmarks/results/*/profiler-traces``,
written by ``tests/test_profiling_gpu.py``) in the chrome-trace format this library reads:
each replay range named ``cuda_graph_runner.replay <phase>/<backend>/bs=<size> <variant>``,
with the backend the file is named after, and at least one graph launch inside every range."""

from __future__ import annotations

import glob
import os
import re

import pytest

from cuda_graph_runner.backend import profiling

ROOT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results")
TRACES = sorted(glob.glob(os.path.join(ROOT, "*", "profiler-traces", "replay-*.trace.json")))
NAME = re.compile(r"cuda_graph_runner\.replay (decode|prefill)/(\w+)/bs=(\d+)( \S+)?")


@pytest.mark.skipif(not TRACES, reason="no H200 replay trace committed yet (tests/test_profiling_gpu.py writes them)")
@pytest.mark.parametrize("path", TRACES, ids=[os.path.relpath(p, ROOT) for p in TRACES])
def test_committed_replay_trace_has_named_ranges_around_graph_launches(path):
    phase, backend = os.path.basename(path).split(".")[0].split("-")[1:3]
    found = profiling.graph_launches_per_replay(path)
    assert found, f"{path}: no replay range"
    for name, launches in found:
        match = NAME.fullmatch(name)
        assert match, name
        assert (match.group(1), match.group(2)) == (phase, backend), name
        assert launches >= 1, f"{name}: no graph launch inside the range"
