"""CPU test of benchmarks/breakable_vs_full.py on hand-made runs:
decode breakable / full against the target, prefill against an earlier run, missing cells.
No timing is measured here."""

from __future__ import annotations

import json
import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import breakable_vs_full  # noqa: E402

from cuda_graph_runner.cli.results_schema import from_run_models  # noqa: E402


def _cell(ms):
    samples = [ms * (1 + 0.01 * ((i * 7) % 5 - 2) / 2) for i in range(6)]
    return {"median_ms": sorted(samples)[3], "min_ms": min(samples), "max_ms": max(samples), "samples_ms": samples}


def _run(breakable_decode, breakable_prefill=10.0, *, decode_breakable=True):
    def model():
        return {
            "decode": {
                str(bs): {"full": _cell(2.0), "breakable": _cell(2.0 * breakable_decode)} for bs in (1, 32, 128)
            },
            "prefill": {"512": {"eager": _cell(20.0), "breakable": _cell(breakable_prefill)}},
        }

    models = {"qwen2.5-0.5b": model(), "llama-3.2-1b": model()}
    if not decode_breakable:
        for m in models.values():
            for row in m["decode"].values():
                row.pop("breakable")
    # As benchmarks/run.py writes its tables: a results document of the current schema.
    return from_run_models(models, {"device": "cuda", "device_name": "test GPU"})


def _main(tmp_path, run, before=None, *extra):
    path = tmp_path / "new.json"
    path.write_text(json.dumps(run))
    argv = [str(path), *extra]
    if before is not None:
        old = tmp_path / "old.json"
        old.write_text(json.dumps(before))
        argv += ["--before", str(old)]
    return breakable_vs_full.main(argv)


def test_within_and_over_the_target(tmp_path, capsys):
    assert _main(tmp_path, _run(1.05)) == 0
    assert "bs    1: 1.050" in capsys.readouterr().out
    assert _main(tmp_path, _run(1.9)) == 1
    assert "OVER" in capsys.readouterr().out
    assert _main(tmp_path, _run(1.9), None, "--max-ratio", "2.0") == 0


def test_prefill_compared_with_the_run_before(tmp_path, capsys):
    assert _main(tmp_path, _run(1.0, breakable_prefill=10.0), _run(1.9, breakable_prefill=10.2)) == 0
    assert "before 0.510" in capsys.readouterr().out
    assert _main(tmp_path, _run(1.0, breakable_prefill=14.0), _run(1.9, breakable_prefill=10.0)) == 1
    assert "WORSE" in capsys.readouterr().out


def test_a_run_without_breakable_says_which_run_to_make(tmp_path, capsys):
    assert _main(tmp_path, _run(1.0, decode_breakable=False)) == 2
    assert "--backends full,breakable" in capsys.readouterr().err
    assert breakable_vs_full.main([str(tmp_path / "absent.json")]) == 2
