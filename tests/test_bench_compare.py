"""CPU tests of the benchmark harness logic: the interleaved steady-state rounds,
the in-run ratios, compare.py's regression rule and make_docs.py's splicing.

All timings are synthetic (a fake clock, hand-made JSON): nothing here measures wall time.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import bench_rounds  # noqa: E402
import compare  # noqa: E402
import make_docs  # noqa: E402
from bench_summary import SCHEMA, ratio_stats, ratios_for  # noqa: E402

from cuda_graph_runner.cli.results_schema import from_run_models  # noqa: E402

ROUNDS = 10


def _cell(ms, noise=0.01, phase=0, rounds=ROUNDS):
    """A timing cell around ``ms`` with a deterministic wobble of +-noise per round; methods
    with another ``phase`` wobble out of step (independent noise)."""
    samples = [ms * (1 + noise * (((i + phase) * 7) % 5 - 2) / 2) for i in range(rounds)]
    return {
        "median_ms": sorted(samples)[rounds // 2],
        "min_ms": min(samples),
        "max_ms": max(samples),
        "samples_ms": samples,
        "warmup_rounds": 4,
        "steady": True,
        "gc_ms": 0.0,
    }


def _run(scale=None, noise=0.01, gpu="NVIDIA H200", extra=None):
    """A synthetic run: llama, bs 1/32/128, eager, hand_graph, reduce_overhead (bs 1, 32) and
    three backends (plus ``extra``: ``{label: ms}``); ``scale`` multiplies one method's
    times, e.g. ``{"breakable": 1.3}``."""
    scale = scale or {}
    base = {
        "eager": 15.0,
        "hand_graph": 2.14,
        "reduce_overhead": 1.4,
        "full": 2.16,
        "tc_piecewise:inductor": 2.55,
        "breakable": 2.43,
        **(extra or {}),
    }
    decode = {}
    for bs, grow in (("1", 1.0), ("32", 1.23), ("128", 1.56)):
        row = {}
        for phase, (method, ms) in enumerate(base.items()):
            if method == "reduce_overhead" and bs == "128":
                continue
            row[method] = _cell(ms * grow * scale.get(method, 1.0), noise, phase)
        decode[bs] = row
    return {
        "schema": SCHEMA,
        "env": {"device": "cuda", "gpu": gpu},
        "settings": {"rounds": ROUNDS},
        "models": {"llama-3.2-1b": {"decode": decode, "ratios": ratios_for(decode), "capture": {}}},
        "notes": [],
    }


# -- bench_rounds ---------------------------------------------------------------------------


class FakeClock:
    """Each method call advances time by its scripted cost; reading the clock is free."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_rounds_interleave_reach_steady_state_and_report_spread():
    clock = FakeClock()
    calls = []
    cold = {"a": 5}  # method a is slow for its first 5 calls (a cold start)

    def make(name, ms):
        def fn():
            calls.append(name)
            extra = 0.0
            if cold.get(name, 0) > 0:
                cold[name] -= 1
                extra = 10.0
            clock.now += (ms + extra) / 1000.0

        return fn

    cells = bench_rounds.run_rounds(
        {"a": make("a", 2.0), "b": make("b", 3.0)},
        iters=2,
        rounds=4,
        sync=lambda: None,
        warmup_min=2,
        warmup_max=20,
        clock=clock,
    )
    a, b = cells["a"], cells["b"]
    assert a.steady and b.steady
    # a's cold calls all fell into the warm-up; measured rounds see only the steady 2 ms.
    assert a.warmup_ms[0] == pytest.approx(12.0)
    assert a.samples_ms == pytest.approx([2.0] * 4)
    assert b.summary()["median_ms"] == pytest.approx(3.0)
    assert len(a.samples_ms) == len(b.samples_ms) == 4
    # Round-robin: the method that opens a round alternates.
    per_round = [calls[i : i + 4] for i in range(0, len(calls), 4)]
    assert {r[0] for r in per_round} == {"a", "b"}


def test_rounds_warmup_cap_reports_unsteady():
    clock = FakeClock()
    state = {"ms": 10.0}

    def drifting():
        state["ms"] *= 0.9  # never settles
        clock.now += state["ms"] / 1000.0

    cells = bench_rounds.run_rounds(
        {"d": drifting}, iters=1, rounds=2, sync=lambda: None, warmup_min=1, warmup_max=7, clock=clock
    )
    assert not cells["d"].steady
    assert len(cells["d"].warmup_ms) == 7
    assert cells["d"].summary()["steady"] is False


def test_rounds_only_must_settle_methods_gate_the_warmup():
    clock = FakeClock()
    state = {"ms": 10.0}

    def wandering():  # like eager: never settles
        state["ms"] *= 0.9
        clock.now += state["ms"] / 1000.0

    def flat():
        clock.now += 0.002

    cells = bench_rounds.run_rounds(
        {"eager": wandering, "g": flat},
        iters=1,
        rounds=2,
        sync=lambda: None,
        warmup_min=1,
        warmup_max=20,
        clock=clock,
        must_settle=["g"],
    )
    assert len(cells["g"].warmup_ms) == 6  # the first moment two windows of 3 exist
    assert cells["g"].steady and not cells["eager"].steady


def test_rounds_min_warmup_time_outlasts_a_slow_plateau():
    """A flat slow plateau passes the steady test; the minimum warm-up time outlasts it."""
    clock = FakeClock()
    calls = {"n": 0}

    def plateau_then_fast():  # 4 ms per call for the first 0.1 s of the run, then 2 ms
        calls["n"] += 1
        clock.now += 0.004 if clock.now < 0.1 else 0.002

    quick = bench_rounds.run_rounds(
        {"p": plateau_then_fast}, iters=1, rounds=3, sync=lambda: None, warmup_min=1, warmup_max=100, clock=clock
    )
    assert quick["p"].steady and quick["p"].samples_ms == pytest.approx([4.0] * 3)  # fooled by the plateau
    clock.now = 0.0
    timed = bench_rounds.run_rounds(
        {"p": plateau_then_fast},
        iters=1,
        rounds=3,
        sync=lambda: None,
        warmup_min=1,
        warmup_max=100,
        warmup_min_s=0.15,
        clock=clock,
    )
    assert timed["p"].steady and timed["p"].samples_ms == pytest.approx([2.0] * 3)
    assert timed["p"].summary()["warmup_ms"][0] == pytest.approx(4.0)


@pytest.mark.parametrize(
    "kw",
    [
        dict(iters=0, rounds=1),
        dict(iters=1, rounds=0),
        dict(iters=1, rounds=1, warmup_min=3, warmup_max=2),
        dict(iters=1, rounds=1, warmup_min_s=-1.0),
    ],
)
def test_rounds_reject_bad_settings(kw):
    with pytest.raises(ValueError, match="must be|need"):
        bench_rounds.run_rounds({"x": lambda: None}, sync=lambda: None, **kw)


def test_is_steady_rule():
    assert not bench_rounds.is_steady([1.0] * 5)  # fewer than 2 windows
    assert bench_rounds.is_steady([1.0, 1.0, 1.0, 1.01, 1.0, 1.01])
    assert not bench_rounds.is_steady([1.0, 1.0, 1.0, 1.1, 1.1, 1.1])


# -- ratios ---------------------------------------------------------------------------------


def test_ratio_pairs_rounds_so_common_drift_cancels():
    drift = [1.0, 1.2, 0.9, 1.1]  # the machine speeds up and slows down for everyone alike
    num = {"median_ms": 3.0, "min_ms": 2.7, "max_ms": 3.6, "samples_ms": [3.0 * d for d in drift]}
    den = {"median_ms": 2.0, "min_ms": 1.8, "max_ms": 2.4, "samples_ms": [2.0 * d for d in drift]}
    r = ratio_stats(num, den)
    assert r["median"] == pytest.approx(1.5)
    assert r["lo"] == pytest.approx(1.5) and r["hi"] == pytest.approx(1.5)


def test_ratios_skip_eager_and_need_a_reference():
    run = _run()
    ratios = run["models"]["llama-3.2-1b"]["ratios"]
    assert set(ratios["1"]) == {"full", "tc_piecewise:inductor", "breakable"}
    assert set(ratios["1"]["full"]) == {"hand_graph", "reduce_overhead"}
    assert set(ratios["128"]["full"]) == {"hand_graph"}  # no reduce-overhead at 128
    assert "eager" not in ratios["1"]


# -- compare --------------------------------------------------------------------------------


def _verdicts(rows):
    return {(r.size, r.method, r.ref): r.verdict for r in rows}


def test_unchanged_run_passes():
    rows = compare.compare(_run(), _run())
    assert rows and not any(r.failed for r in rows)
    assert {r.verdict for r in rows} == {"ok"}


def test_results_with_the_deprecated_compiled_full_label_compare_with_its_replacement():
    """Results written as ``full:inductor`` compare with ``full+torch_compile`` (the label's
    new spelling): the same ratios, not MISSING and new."""
    old = _run(extra={"full:inductor": 1.2})
    rows = compare.compare(old, _run(extra={"full+torch_compile": 1.2}))
    assert {r.verdict for r in rows} == {"ok"}
    assert {r.method for r in rows} >= {"full+torch_compile"} and "full:inductor" not in {r.method for r in rows}
    slower = compare.compare(old, _run(extra={"full+torch_compile": 1.5}))
    assert {r.method for r in slower if r.verdict == "REGRESSION"} == {"full+torch_compile"}


def test_slowed_backend_is_flagged_and_only_it():
    rows = compare.compare(_run(), _run(scale={"breakable": 1.3}))
    flagged = {(s, m, ref) for (s, m, ref), v in _verdicts(rows).items() if v == "REGRESSION"}
    assert flagged == {
        (bs, "breakable", ref)
        for bs in ("1", "32", "128")
        for ref in ("hand_graph", "reduce_overhead")
        if not (bs == "128" and ref == "reduce_overhead")
    }
    assert all(r.verdict == "ok" for r in rows if r.method != "breakable")


def test_slowed_reference_is_seen_as_improvement_not_regression():
    # A slower hand-written graph makes every ratio smaller: never a false alarm.
    rows = compare.compare(_run(), _run(scale={"hand_graph": 1.3}))
    assert not any(r.failed for r in rows)
    assert {v for (s, m, ref), v in _verdicts(rows).items() if ref == "hand_graph"} == {"better"}


def test_noise_within_spread_passes():
    # Both runs noisy (+-15% per round); the new one is 12% slower on the median, inside the spread.
    rows = compare.compare(_run(noise=0.15), _run(scale={"breakable": 1.12}, noise=0.15))
    assert not any(r.failed for r in rows)
    assert "noisy" in {r.verdict for r in rows if r.method == "breakable"}


def test_small_change_passes():
    rows = compare.compare(_run(), _run(scale={"full": 1.08}))
    assert not any(r.failed for r in rows)


def test_judge_rule_edges():
    base = {"median": 1.0, "lo": 0.98, "hi": 1.02}
    assert compare.judge(base, {"median": 1.11, "lo": 1.03, "hi": 1.2}, 0.10) == "REGRESSION"
    assert compare.judge(base, {"median": 1.11, "lo": 1.01, "hi": 1.2}, 0.10) == "noisy"
    assert compare.judge(base, {"median": 1.09, "lo": 1.08, "hi": 1.1}, 0.10) == "ok"
    assert compare.judge(base, {"median": 0.85, "lo": 0.8, "hi": 0.9}, 0.10) == "better"


def test_missing_backend_fails():
    new = _run()
    for row in new["models"]["llama-3.2-1b"]["ratios"].values():
        row.pop("tc_piecewise:inductor")
    rows = compare.compare(_run(), new)
    missing = [r for r in rows if r.verdict == "MISSING"]
    assert missing and all(r.method == "tc_piecewise:inductor" for r in missing)


def test_other_gpu_refused_unless_allowed():
    with pytest.raises(compare.CompareError, match="GPU"):
        compare.compare(_run(), _run(gpu="NVIDIA A100"))
    assert compare.compare(_run(), _run(gpu="NVIDIA A100"), allow_other_gpu=True)


def _write(tmp_path, name, data):
    """Write ``data``; run.py's tables (``_run()``) in the results schema, as run.py writes them."""
    if data.get("schema") == SCHEMA and "models" in data and not data.get("placeholder"):
        data = from_run_models(data["models"], data["env"], settings=data.get("settings"), notes=data["notes"])
    p = tmp_path / name
    p.write_text(json.dumps(data))
    return str(p)


def test_main_exit_codes_and_table(tmp_path, capsys):
    base = _write(tmp_path, "base.json", _run())
    same = _write(tmp_path, "same.json", _run())
    slow = _write(tmp_path, "slow.json", _run(scale={"tc_piecewise:inductor": 1.3}))
    assert compare.main([same, "--baseline", base]) == 0
    assert "OK" in capsys.readouterr().out
    assert compare.main([slow, "--baseline", base]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION" in out and "| llama-3.2-1b | decode | 1 | tc_piecewise:inductor | hand_graph |" in out


def test_placeholder_and_bad_baselines_are_refused_clearly(tmp_path, capsys):
    new = _write(tmp_path, "new.json", _run())
    placeholder = _write(tmp_path, "p.json", {"schema": SCHEMA, "placeholder": True, "models": {}})
    assert compare.main([new, "--baseline", placeholder]) == 2
    err = capsys.readouterr().err
    assert "placeholder" in err and "benchmarks/run.py" in err
    assert compare.main([new, "--baseline", str(tmp_path / "absent.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    no_ratios = _write(
        tmp_path,
        "no_ratios.json",
        from_run_models({"x": {"decode": {"1": {"full": {"median_ms": 2.0}}}}}, {"device": "cuda"}),
    )
    assert compare.main([new, "--baseline", no_ratios]) == 2
    assert "no ratios" in capsys.readouterr().err
    tables = tmp_path / "tables.json"  # run.py's tables as they are, not in the results schema
    tables.write_text(json.dumps(_run()))
    tables = str(tables)
    assert compare.main([new, "--baseline", tables]) == 2
    assert f"schema {SCHEMA!r} is not accepted; accepted: 'cuda-graph-runner.results/3'" in capsys.readouterr().err
    other = _write(tmp_path, "other.json", {"schema": "something/9", "models": {}})
    assert compare.main([new, "--baseline", other]) == 2
    assert "schema 'something/9'" in capsys.readouterr().err
    assert compare.main([new, "--baseline", new, "--threshold", "10"]) == 2
    assert "--threshold" in capsys.readouterr().err


def test_stored_baseline_is_valid_or_a_clear_placeholder(capsys):
    """The repository's baseline either holds real ratios or is refused with instructions."""
    path = compare.DEFAULT_BASELINE
    with open(path) as f:
        data = json.load(f)
    if data.get("placeholder"):
        with pytest.raises(compare.CompareError, match="placeholder"):
            compare.load(path, "baseline")
    else:
        loaded = compare.load(path, "baseline")
        assert any(m.get("ratios") for m in loaded["models"].values())


# -- make_docs ------------------------------------------------------------------------------


def test_make_docs_renders_spread_and_splices_only_the_region(tmp_path):
    run = _run()
    text = make_docs.render(run)
    assert "| batch | eager | hand_graph | reduce_overhead |" in text
    cell = run["models"]["llama-3.2-1b"]["decode"]["1"]["full"]
    assert f"{cell['median_ms']:.3f} [{cell['min_ms']:.3f}-{cell['max_ms']:.3f}]" in text
    doc = f"# Title\n\nprose kept\n\n{make_docs.BEGIN}\nold numbers\n{make_docs.END}\n\nmore prose\n"
    new = make_docs.splice(doc, text)
    assert "old numbers" not in new and "prose kept" in new and "more prose" in new
    assert make_docs.splice(new, text) == new  # idempotent
    with pytest.raises(ValueError, match="BEGIN"):
        make_docs.splice("no markers", text)
    runs = make_docs.render_runs([run, _run(scale={"full": 1.05})], ["a", "b"])
    assert "| llama-3.2-1b | 1 | full |" in runs and "5.0%" in runs


def test_make_docs_main_writes_doc(tmp_path):
    doc = tmp_path / "b.md"
    doc.write_text(f"intro\n{make_docs.BEGIN}\n{make_docs.END}\n")
    a = _write(tmp_path, "a.json", _run())
    b = _write(tmp_path, "b.json", copy.deepcopy(_run()))
    assert make_docs.main([a, b, "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("intro\n") and "Run to run: 2 runs" in text


def test_make_docs_extra_renders_the_stored_folder_and_splices(tmp_path):
    import make_docs_extra

    folder = tmp_path / "res"
    folder.mkdir()
    (folder / "capture_seconds.json").write_text(
        json.dumps({"device": "GPU X", "rows": {"auto": {"capture_s": 1.234, "sizes": 36, "pool_mb": 226.0}}})
    )
    (folder / "tp2.json").write_text(
        json.dumps(
            {
                "model": "m",
                "dtype": "bfloat16",
                "tp": 2,
                "rows": [{"batch_size": 8, "eager_ms": 20.0, "comm_ms": 0.5, "full_forward_ms": 2.5}],
                "runners": {"full": {"capture_s": 0.5, "graph_memory_mib": 186.0}},
            }
        )
    )
    text = make_docs_extra.render(str(folder))
    assert "| auto | 36 | 1.23 | 226 |" in text
    # One column per backend the JSON has (here full only): no column of an absent backend.
    assert "| 2 | 8 | 20.000 | 0.500 | 2.500 |\n" in text
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{make_docs_extra.BEGIN}\nold\n{make_docs_extra.END}\noutro\n")
    assert make_docs_extra.main([str(folder), "--doc", str(doc)]) == 0
    new = doc.read_text()
    assert "old" not in new and "| auto | 36 |" in new and new.startswith("intro") and new.endswith("outro\n")
    assert make_docs_extra.main([str(tmp_path / "missing")]) == 2
