"""GPU: benchmarks/run.py end to end on the tiny preset: every method is built
before timing, timed in interleaved rounds, and the JSON has the cells and in-run ratios
that compare.py and make_docs.py read. Structure only: no assertion on a time.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

pytestmark = pytest.mark.gpu

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

ROUNDS = 3


@pytest.fixture(scope="module")
def run_json(tmp_path_factory):
    import run  # benchmarks/run.py (imports torch and the packages)

    out = tmp_path_factory.mktemp("bench")
    rc = run.main(
        [
            "--out",
            str(out),
            "--models",
            "tiny",
            "--batch-sizes",
            "1",
            "2",
            "--backends",
            "full,breakable,tc_piecewise",
            "--reduce-overhead-bs",
            "1",
            "2",
            "--prefill-tokens",
            "16",
            "--iters",
            "2",
            "--rounds",
            str(ROUNDS),
            "--warmup-max",
            "4",
            "--pin-cpu",
            "auto",
            "--inject-sleep-ms",
            "breakable=0",
        ]
    )
    assert rc == 0
    from cuda_graph_runner.cli.results_schema import nested_view

    with open(out / "benchmarks.json") as f:
        doc = json.load(f)
    # run.py's per-model layout (what make_docs renders), with the stored document beside it.
    return {**nested_view(doc), "document": doc}


def test_every_method_has_a_cell_with_spread(run_json):
    m = run_json["models"]["tiny"]
    assert not [n for n in run_json["notes"] if "failed" in n], run_json["notes"]
    for bs in ("1", "2"):
        row = m["decode"][bs]
        assert set(row) == {"eager", "hand_graph", "reduce_overhead", "full", "breakable", "tc_piecewise"}
        for cell in row.values():
            assert len(cell["samples_ms"]) == ROUNDS
            assert cell["min_ms"] <= cell["median_ms"] <= cell["max_ms"]
            assert cell["warmup_rounds"] >= 3
    assert set(m["prefill"]["16"]) >= {"eager"}
    # The floors beside the table, from rates measured in the run.
    assert set(m["floor_ms"]["decode"]) == {"1", "2"} and set(m["floor_ms"]["prefill"]) == {"16"}
    assert 0 < m["floor_ms"]["decode"]["1"] < m["decode"]["1"]["hand_graph"]["median_ms"]
    assert m["device_rates"]["copy_gbps"] > 100 and m["device_rates"]["gemm_tflops"] > 1


def test_ratios_to_both_references_and_env(run_json):
    m = run_json["models"]["tiny"]
    for bs in ("1", "2"):
        for backend in ("full", "breakable", "tc_piecewise"):
            r = m["ratios"][bs][backend]
            assert set(r) == {"hand_graph", "reduce_overhead"}
            assert r["hand_graph"]["lo"] <= r["hand_graph"]["median"] <= r["hand_graph"]["hi"]
    env = run_json["env"]
    assert env["device"] == "cuda" and env["inject_sleep_ms"] == {"breakable": 0.0}
    assert env["inductor_config"]["mode"] == "pinned"
    assert "clock_rate_mhz" in env["gpu_at_start"]
    assert m["python_objects_before_timing"] > 0


def test_compare_passes_a_run_against_itself_and_docs_render(run_json, tmp_path):
    import compare
    import make_docs

    path = tmp_path / "r.json"
    path.write_text(json.dumps(run_json["document"]))
    assert compare.main([str(path), "--baseline", str(path)]) == 0
    assert "#### tiny: decode time / reference time" in make_docs.render(run_json)
