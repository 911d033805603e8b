"""benchmarks/run.py --isolate: which methods get a fresh process, and how the processes'
rows merge into one run (benchmarks/isolated.py); end to end on the CPU with the tiny preset."""

from __future__ import annotations

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import isolated  # noqa: E402


def test_every_compiling_method_gets_a_process_of_its_own():
    plan = isolated.groups(["full", "full+torch_compile", "breakable", "tc_piecewise", "tc_piecewise:inductor"], True)
    assert plan == {
        "base": ["full", "breakable"],
        "full+torch_compile": ["full+torch_compile"],
        "tc_piecewise": ["tc_piecewise"],
        "tc_piecewise:inductor": ["tc_piecewise:inductor"],
        "reduce_overhead": [],
    }
    assert list(isolated.groups(["full"], False)) == ["base"]
    assert isolated.dir_name("tc_piecewise:inductor") == "tc_piecewise_inductor"


def _cell(ms, samples):
    return {"median_ms": ms, "min_ms": min(samples), "max_ms": max(samples), "samples_ms": samples}


def _view(rows, ratios=None, notes=(), **extra):
    return {"notes": list(notes), "models": {"m": {"decode": rows, "ratios": ratios or {}, **extra}}}


def test_merge_keeps_each_ratio_from_the_method_s_own_process():
    base = _view(
        {"1": {"eager": _cell(9.0, [9.0]), "hand_graph": _cell(1.0, [1.0]), "full": _cell(1.1, [1.1])}},
        {"1": {"full": {"hand_graph": {"median": 1.1, "lo": 1.0, "hi": 1.2}}}},
        notes=["base note"],
        capture={"full": {"sizes": 1}},
        floor_ms={"decode": {"1": 0.5}},
    )
    # In its own process the hand graph ran at 2.0 ms: the ratio is against that, not base's 1.0.
    tc = _view(
        {
            "1": {
                "eager": _cell(8.0, [8.0]),
                "hand_graph": _cell(2.0, [2.0]),
                "tc_piecewise:inductor": _cell(2.2, [2.2]),
            }
        },
        {"1": {"tc_piecewise:inductor": {"hand_graph": {"median": 1.1, "lo": 1.05, "hi": 1.15}}}},
        capture={"tc_piecewise:inductor": {"sizes": 1}, "stray": {"sizes": 9}},
    )
    ro = _view(
        {
            "1": {
                "eager": _cell(7.0, [7.0]),
                "hand_graph": _cell(1.0, [1.0, 1.0]),
                "reduce_overhead": _cell(2.0, [2.0, 2.5]),
            }
        }
    )
    models, notes = isolated.merge(
        [
            ("base", ["full"], base),
            ("tc_piecewise:inductor", ["tc_piecewise:inductor"], tc),
            ("reduce_overhead", [], ro),
        ]
    )
    m = models["m"]
    assert set(m["decode"]["1"]) == {"eager", "hand_graph", "full", "tc_piecewise:inductor", "reduce_overhead"}
    assert m["decode"]["1"]["hand_graph"]["median_ms"] == 1.0  # the table's references: base's
    tc_ratio = m["ratios"]["1"]["tc_piecewise:inductor"]
    assert tc_ratio["hand_graph"] == {"median": 1.1, "lo": 1.05, "hi": 1.15}
    # hand / reduce_overhead in its process: median 0.5, rounds 1/2 and 1/2.5.
    assert tc_ratio["reduce_overhead"] == {"median": 0.55, "lo": round(1.05 * 0.4, 5), "hi": round(1.15 * 0.5, 5)}
    assert m["ratios"]["1"]["full"]["reduce_overhead"]["median"] == pytest.approx(0.55)
    assert m["ratio_via"] == {"reduce_overhead": "hand_graph"}
    assert set(m["capture"]) == {"full", "tc_piecewise:inductor"}  # a group adds its own methods only
    assert m["floor_ms"] == {"decode": {"1": 0.5}}
    assert m["isolated"]["tc_piecewise:inductor"]["references_median_ms"]["decode"]["1"]["hand_graph"] == 2.0
    assert notes == ["[base] base note"]

    import make_docs

    from cuda_graph_runner.cli.results_schema import from_json, from_run_models, nested_view

    doc = from_json(from_run_models(models, {"device": "cuda"}))
    assert nested_view(doc)["models"]["m"]["ratios"]["1"]["tc_piecewise:inductor"] == tc_ratio
    assert "tc_piecewise:inductor" in make_docs.render(nested_view(doc))


def test_run_py_isolate_merges_its_processes_on_cpu(tmp_path):
    import run

    argv = ["--device", "cpu", "--models", "tiny", "--batch-sizes", "1", "--quick", "--prefill-tokens"]
    argv += ["--iters", "1", "--rounds", "1", "--warmup-min", "0", "--warmup-max", "1", "--warmup-min-s", "0"]
    argv += ["--backends", "full,tc_piecewise", "--isolate", "--out", str(tmp_path)]
    assert run.main(argv) == 0
    from cuda_graph_runner.cli.results_schema import nested_view, read

    view = nested_view(read(str(tmp_path / "benchmarks.json")))
    assert view["env"]["isolated_processes"] == {"base": ["full"], "tc_piecewise": ["tc_piecewise"]}
    m = view["models"]["tiny"]
    assert set(m["decode"]["1"]) == {"eager", "hand_graph"}  # the CPU smoke test times no backend
    assert set(m["isolated"]) == {"base", "tc_piecewise"}
    for group in ("base", "tc_piecewise"):
        child = json.loads((tmp_path / "isolated" / group / "benchmarks.json").read_text())
        assert child["settings"]["isolated_group"] == group
        assert m["isolated"][group]["references_median_ms"]["decode"]["1"]["hand_graph"] > 0
    assert any(n.startswith("[tc_piecewise] tiny: decode backend tc_piecewise skipped") for n in view["notes"])
    assert not any(n.startswith("[base]") and "tc_piecewise" in n for n in view["notes"])
