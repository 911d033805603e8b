"""The one results schema of ``bench`` and ``benchmarks/run.py``: validation names the bad
field, a document of another schema is refused naming both schemas, the stored files read."""

from __future__ import annotations

import copy
import glob
import json
import os
import sys

import pytest

from cuda_graph_runner.cli.results_schema import (
    SCHEMA,
    ResultsSchemaError,
    document,
    from_bench_rows,
    from_json,
    from_run_models,
    nested_view,
    read,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
STORED = sorted(
    p
    for p in glob.glob(os.path.join(ROOT, "benchmarks", "baseline", "*.json"))
    + glob.glob(os.path.join(ROOT, "benchmarks", "results", "*", "*.json"))
    if "schema" in json.load(open(p))  # results documents (the others are other scripts' tables)
)


def _doc():
    return document(
        "bench",
        {"device": "cpu", "model": "tiny"},
        timings=[
            {"model": "tiny", "phase": "decode", "method": "full", "batch_size": 1, "median_ms": 0.5, "eager_ms": 2.0},
            {"model": "tiny", "phase": "prefill", "method": "eager", "num_tokens": 8, "requests": 2, "median_ms": 3.0},
        ],
        runners=[{"model": "tiny", "phase": "decode", "backend": "full", "num_sizes": 2, "capture_s": 0.1}],
    )


def test_results_documents_are_stored():
    assert len(STORED) >= 8 and any("baseline" in p for p in STORED)


@pytest.mark.parametrize("path", STORED, ids=os.path.basename)
def test_stored_results_files_are_of_the_schema_and_read(path):
    doc = read(path)
    assert doc["schema"] == SCHEMA and doc["timings"]
    view = nested_view(doc)
    assert view["models"] and all(tables.get("decode") or tables.get("prefill") for tables in view["models"].values())


@pytest.mark.parametrize("schema", ["cuda-graph-runner-benchmarks/2", "cuda-graph-runner.bench/1", None])
def test_a_document_of_another_schema_is_refused_naming_both(tmp_path, schema):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"schema": schema, "env": {}, "models": {"m": {"decode": {"1": {"full": 2.0}}}}}))
    with pytest.raises(ResultsSchemaError) as info:
        read(str(path))
    message = str(info.value)
    assert message.startswith(str(path)) and f"schema {schema!r} is not accepted" in message
    assert f"accepted: {SCHEMA!r}" in message


def test_compare_reads_the_stored_baseline_and_finds_no_change():
    import compare

    base = compare.load(compare.DEFAULT_BASELINE, "baseline")
    rows = compare.compare(base, base)
    assert rows and all(r.verdict == "ok" for r in rows)


def test_a_written_document_is_read_back_unchanged():
    doc = _doc()
    assert from_json(json.loads(json.dumps(doc))) == doc


@pytest.mark.parametrize(
    "edit,named",
    [
        (
            lambda d: d["timings"][0].update(median_ms="fast"),
            "timings[0].median_ms: expected a number or null, got 'fast'",
        ),
        (lambda d: d["timings"][0].update(media_ms=1.0), "timings[0].media_ms: unknown field"),
        (lambda d: d["timings"][1].pop("median_ms"), "timings[1].median_ms: missing (required)"),
        (lambda d: d["timings"][0].update(phase="extend"), "timings[0].phase: expected one of decode, prefill"),
        (
            lambda d: d["timings"][0].update(num_tokens=4),
            "timings[0]: a decode record has batch_size and no num_tokens",
        ),
        (lambda d: d["timings"][0].update(batch_size=True), "timings[0].batch_size: expected an int"),
        (lambda d: d["runners"][0].pop("num_sizes"), "runners[0].num_sizes: missing"),
        (lambda d: d["env"].pop("device"), "env.device"),
        (lambda d: d.update(tool="other"), "tool: expected one of bench, benchmarks/run.py"),
        (lambda d: d.update(notes=[1]), "notes: expected a list of str"),
        (lambda d: d.update(schema="cuda-graph-runner.results/99"), "schema 'cuda-graph-runner.results/99'"),
    ],
)
def test_validation_names_the_bad_field(edit, named):
    doc = copy.deepcopy(_doc())
    edit(doc)
    with pytest.raises(ResultsSchemaError) as info:
        from_json(doc, "my.json")
    assert str(info.value).startswith("my.json") and named in str(info.value)


def test_bench_rows_become_timings_and_runners():
    old = {
        "env": {"device": "cpu", "model": "tiny"},
        "runners": [{"phase": "decode", "backend": "full", "sizes": [1, 2], "capture_s": 0.1, "graph_memory_mb": 3.0}],
        "decode": [
            {"batch_size": 1, "backend": "full", "eager_ms": 2.0, "graph_ms": 0.5, "speedup": 4.0, "tokens_match": True}
        ],
        "prefill": [{"num_tokens": 8, "requests": 2, "backend": "disabled", "eager_ms": 3.0}],
        "notes": ["n"],
    }
    doc = from_bench_rows(old)
    full, eager = doc["timings"]
    assert full["method"] == "full" and full["median_ms"] == 0.5 and full["eager_ms"] == 2.0 and full["tokens_match"]
    assert eager == {
        "model": "tiny",
        "phase": "prefill",
        "method": "eager",
        "num_tokens": 8,
        "requests": 2,
        "median_ms": 3.0,
    }
    assert doc["runners"][0]["num_sizes"] == 2 and doc["runners"][0]["graph_memory_mib"] == 3.0


def test_run_tables_with_a_bad_cell_name_the_field():
    with pytest.raises(ResultsSchemaError, match=r"timings\[0\]\.median_ms"):
        from_run_models({"m": {"decode": {"1": {"full": {"median_ms": "x"}}}}}, {"device": "cuda"})
    with pytest.raises(ResultsSchemaError, match=r"models\.m\.decode\.1\.full: expected a timing object"):
        from_run_models({"m": {"decode": {"1": {"full": 2.0}}}}, {"device": "cuda"})


def test_make_docs_refuses_a_broken_file_naming_the_field(tmp_path, capsys):
    import make_docs

    doc = _doc()
    doc["timings"][0]["median_ms"] = "slow"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    assert make_docs.main([str(path), "--print"]) == 2
    assert "timings[0].median_ms" in capsys.readouterr().err


def test_bench_rows_timed_in_rounds_give_samples_and_a_ratio_against_eager():
    rows = {
        "env": {"device": "cpu", "model": "tiny"},
        "decode": [
            {
                "batch_size": 1,
                "backend": "compiled",
                "eager_ms": 2.0,
                "graph_ms": 1.0,
                "speedup": 2.0,
                "speedup_lo": 1.6,
                "speedup_hi": 2.5,
                "graph_samples_ms": [1.0, 1.25, 0.8],
            }
        ],
        # prefill rows have a request count the ratio record cannot hold: samples only
        "prefill": [
            {
                "num_tokens": 8,
                "requests": 2,
                "backend": "compiled",
                "eager_ms": 3.0,
                "graph_ms": 1.5,
                "speedup": 2.0,
                "speedup_lo": 1.5,
                "speedup_hi": 2.2,
                "graph_samples_ms": [1.5],
            }
        ],
    }
    doc = from_json(from_bench_rows(rows), "bench")
    decode, prefill = doc["timings"]
    assert (decode["samples_ms"], decode["min_ms"], decode["max_ms"]) == ([1.0, 1.25, 0.8], 0.8, 1.25)
    assert prefill["samples_ms"] == [1.5]
    (ratio,) = doc["ratios"]
    assert (ratio["method"], ratio["reference"], ratio["batch_size"]) == ("compiled", "eager", 1)
    assert ratio["median"] == pytest.approx(0.5)
    assert (ratio["lo"], ratio["hi"]) == (pytest.approx(1 / 2.5), pytest.approx(1 / 1.6))
