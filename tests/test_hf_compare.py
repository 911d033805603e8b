"""benchmarks/hf_compare.py on the CPU: a smoke run on the tiny config (graphs emulated,
nothing compiled) writes a results document of the shared schema with every method's
measures, and make_docs_extra renders its table from that file; bad flags are named."""

from __future__ import annotations

import json
import os
import shlex
import sys

import pytest

pytest.importorskip(
    "transformers", reason="hf_compare needs transformers: pip install 'cuda-graph-runner[transformers]'"
)

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
sys.path.insert(0, BENCH)

import hf_compare  # noqa: E402
import make_docs  # noqa: E402
import make_docs_extra  # noqa: E402

from cuda_graph_runner.cli.results_schema import read  # noqa: E402

METHODS = ["full", "breakable", "hf_eager", "hf_static"]


def test_smoke_run_writes_the_results_document_and_its_table(tmp_path, capsys):
    folder = tmp_path / "2026-12-01-cpu-hf-compare"
    out = folder / "hf_compare.json"
    argv = ["--device", "cpu", "--shapes", "tiny", "--methods", ",".join(METHODS), "--prompt-len", "4"]
    argv += ["--ragged", "3", "--new-tokens", "4", "--iters", "1", "--out", str(out)]
    assert hf_compare.main(argv) == 0
    # Progress lines name each step as it ends, so a run cut off by a timeout shows where it was.
    err = capsys.readouterr().err
    assert "transformers " in err.splitlines()[0] and err.rstrip().endswith(f"wrote {out}")
    for method in METHODS:
        assert f"tiny: {method}/forward batch 1: " in err, err
        assert f"tiny: {method}/e2e batch 3: " in err or f"tiny {method}/e2e batch 3 not recorded: " in err, err
    doc = read(str(out))  # validates against the schema
    assert doc["tool"] == "benchmarks/hf_compare.py" and doc["settings"]["shapes"] == ["tiny"]
    got = {(t["method"], t["batch_size"]) for t in doc["timings"]}
    # A loop cell under the timing noise of two tiny CPU steps is left out with a note, never 0 ms.
    noted = {n.split(" not recorded: ")[0] for n in doc["notes"] if " not recorded: " in n}
    for method in METHODS:
        assert (f"{method}/forward", 1) in got, method
        for bs in (1, 3):
            assert (f"{method}/e2e", bs) in got or f"tiny {method}/e2e batch {bs}" in noted, (method, bs)
    # The noise rule must not empty the loop rows: at least one loop cell is measured.
    assert any(method.endswith("/e2e") for method, _ in got), noted
    assert all(t["median_ms"] > 0 for t in doc["timings"])
    # Our forward's logits against transformers' own forward of the same tokens.
    checked = [t for t in doc["timings"] if t["method"] in ("full/forward", "breakable/forward")]
    assert len(checked) == 2 and all(t["within_tolerance"] and t["max_abs_diff"] < 1e-3 for t in checked), checked
    assert {r["backend"] for r in doc["runners"]} == {"full", "breakable", "hf_static"}
    assert set(doc["extra"]["batch_semantics"]) == set(METHODS)
    text = make_docs_extra.render(str(folder))
    header = next(line for line in text.splitlines() if line.startswith("| model | batch | measure"))
    assert header.split(" | ")[3:7] == ["full", "breakable", "HF eager generate", "HF static cache"]
    assert "| tiny | 3 | end to end |" in text
    assert make_docs_extra.folders(str(tmp_path))[0][2] == "hf-compare"
    page = make_docs.render_store(str(tmp_path))  # the docs page's section of the newest hf-compare folder
    assert "### Hugging Face models: ours against HF generate" in page and "| tiny | 1 | forward only |" in page


def test_e2e_batches_picks_the_loops_batches(tmp_path):
    out = tmp_path / "hf_compare.json"
    argv = ["--device", "cpu", "--shapes", "tiny", "--methods", "full,hf_static", "--measures", "e2e"]
    argv += ["--e2e-batches", "ragged", "--prompt-len", "4", "--ragged", "3", "--new-tokens", "4"]
    assert hf_compare.main([*argv, "--iters", "1", "--out", str(out)]) == 0
    doc = read(str(out))
    cells = {(t["method"], t["batch_size"]) for t in doc["timings"]}
    noted = [n for n in doc["notes"] if " not recorded: " in n]
    assert cells | {(n.split()[1], int(n.split()[3])) for n in noted} == {("full/e2e", 3), ("hf_static/e2e", 3)}
    assert doc["settings"]["e2e_batches"] == [3]
    # No forward measured, no batch-1 loop: our runner captures the ragged batch alone.
    assert [(r["sizes"], r["num_sizes"]) for r in doc["runners"] if r["backend"] == "full"] == [([3], 1)]
    assert any("first generate() at batch 3 " in n and "batch 1" not in n for n in doc["notes"]), doc["notes"]


def test_a_run_cut_short_keeps_the_cells_it_finished(tmp_path, monkeypatch):
    # A device run is bounded by a time limit: the JSON is rewritten after every cell.
    def cut(*args, **kwargs):
        raise KeyboardInterrupt  # as `timeout -s INT` ends the process

    monkeypatch.setattr(hf_compare, "ours_e2e", cut)
    out = tmp_path / "hf_compare.json"
    argv = ["--device", "cpu", "--shapes", "tiny", "--methods", "full", "--prompt-len", "4"]
    argv += ["--ragged", "3", "--new-tokens", "4", "--iters", "1", "--out", str(out)]
    with pytest.raises(KeyboardInterrupt):
        hf_compare.main(argv)
    doc = read(str(out))
    assert [(t["method"], t["batch_size"]) for t in doc["timings"]] == [("full/forward", 1)]
    assert [r["backend"] for r in doc["runners"]] == ["full"] and doc["extra"]["ragged_prompt_lens"]["tiny"]
    assert not list(tmp_path.glob("*.tmp"))


def test_a_cut_hf_run_keeps_its_first_calls_and_e2e_alone_skips_the_forward(tmp_path, monkeypatch):
    # HF's first calls (the compile, on the GPU) are recorded before its timed cells.
    timed_forward = []
    monkeypatch.setattr(hf_compare, "timed", lambda *a, **k: timed_forward.append(1))

    def cut(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_compare, "per_step", cut)
    out = tmp_path / "hf_compare.json"
    argv = ["--device", "cpu", "--shapes", "tiny", "--methods", "hf_static", "--measures", "e2e", "--prompt-len", "4"]
    argv += ["--e2e-batches", "1", "--new-tokens", "2", "--iters", "1", "--out", str(out)]
    with pytest.raises(KeyboardInterrupt):
        hf_compare.main(argv)
    doc = read(str(out))
    assert [r["backend"] for r in doc["runners"]] == ["hf_static"] and "compile_s" not in doc["runners"][0]
    assert any(n.startswith("tiny hf_static: first generate() at batch 1 ") for n in doc["notes"]), doc["notes"]
    assert not any("forward calls" in n for n in doc["notes"]) and not timed_forward


def test_an_hf_cell_that_raises_is_a_note_and_the_other_cells_still_run(tmp_path, monkeypatch, capsys):
    # As the H200's transformers did: static cache + reduce-overhead raised in its first generate().
    real = hf_compare.hf_generate_fn

    def failing(model, prompts, static):
        if len(prompts) == 1 or not static:
            raise RuntimeError("accessing tensor output of CUDAGraphs that has been overwritten")
        return real(model, prompts, static)

    monkeypatch.setattr(hf_compare, "hf_generate_fn", failing)
    out = tmp_path / "hf_compare.json"
    argv = ["--device", "cpu", "--shapes", "tiny", "--methods", "hf_eager,hf_static", "--prompt-len", "4"]
    argv += ["--ragged", "3", "--new-tokens", "4", "--iters", "1", "--out", str(out)]
    assert hf_compare.main(argv) == 0
    doc = read(str(out))
    failed = "raised: RuntimeError: accessing tensor output of CUDAGraphs that has been overwritten"
    static_note = next(n for n in doc["notes"] if n.startswith("tiny hf_static: "))
    assert f"hf_static/e2e batch 1 {failed}" in static_note and "first generate() at batch 3 " in static_note
    assert f"tiny hf_eager/e2e batch 1 {failed}" in doc["notes"]
    assert f"tiny hf_eager/e2e batch 3 {failed}" in doc["notes"]
    got = {(t["method"], t["batch_size"]) for t in doc["timings"]}
    assert {("hf_eager/forward", 1), ("hf_static/forward", 1)} <= got  # the cells before and around the failures
    assert f"wrote {out}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--methods", "full,hf_fast"], "--methods 'full,hf_fast': unknown ['hf_fast']; accepted: full, "),
        (["--shapes", "llama-3-8b"], "--shapes 'llama-3-8b': unknown ['llama-3-8b']; accepted: llama-3.2-1b, "),
        (["--device", "cpu", "--methods", "hf_static_ro"], "--device cpu: full+torch_compile, hf_static_ro"),
        (["--new-tokens", "0"], "--new-tokens 0: must be >= 1"),
        (["--e2e-batches", "1,32"], "--e2e-batches '1,32': unknown ['32']; accepted: 1, ragged"),
        (["--measures", "forward,ttft"], "--measures 'forward,ttft': unknown ['ttft']; accepted: forward, e2e"),
        (["--iters", "2", "--steps", "50"], "--iters 2 sets --steps and --repeats; not with --steps 50"),
        (["--iters", "0"], "--iters 0: must be >= 1"),
        (["--ragged", "1"], "--ragged 1: the ragged batch needs at least 2 prompts"),
        (["--ragged", "0"], "--ragged 0: the ragged batch needs at least 2 prompts"),
        (["--device", "foo"], "--device 'foo': not a device; accepted: cuda, cuda:N, cpu"),
        (["--device", "cuda:x"], "--device 'cuda:x': not a device; accepted: cuda, cuda:N, cpu"),
        (["--device", "meta"], "--device 'meta': accepted: cuda, cuda:N, cpu"),
        (["--device", "cpu", "--methods", "full", "--attention", "zzz"], "--attention 'zzz': accepted "),
    ],
)
def test_bad_flags_are_named(capsys, argv, message):
    assert hf_compare.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.count("\n") == 1, err


def test_the_attention_check_takes_the_adapter_s_backend_names():
    from cuda_graph_runner.reference.model import attention_backend_names

    names = attention_backend_names()
    assert hf_compare.attention_problem(None) is None  # the default: torch
    assert all(hf_compare.attention_problem(name) is None for name in names)
    problem = hf_compare.attention_problem("zzz")
    assert problem.split("accepted ", 1)[1].split(" (default")[0].split(", ") == names


def test_our_runners_capture_batch_1_only_for_a_measure_that_runs_it():
    assert hf_compare.capture_sizes(["e2e"], [32]) == [32]
    assert hf_compare.capture_sizes(["e2e"], [1, 32]) == [1, 32]
    assert hf_compare.capture_sizes(["forward"], [32]) == [1]
    assert hf_compare.capture_sizes(["forward", "e2e"], [32]) == [1, 32]


def test_a_loop_time_under_the_noise_is_unmeasured_not_zero(monkeypatch):
    # T(n + 1) below T(1): the difference is noise; it must not become a 0 ms step.
    walls = iter([0.010, 0.009, 0.010, 0.030])
    monkeypatch.setattr(hf_compare, "wall_s", lambda fn, sync: next(walls))
    cell = hf_compare.per_step(lambda n: None, steps=2, repeats=2, sync=lambda: None)
    assert cell["samples_ms"] == pytest.approx([-0.5, 10.0])
    assert cell["unmeasured"] == "T(3) <= T(1) in 1 of 2 repeats (noise; raise --new-tokens)"
    walls = iter([0.010, 0.030])
    assert "unmeasured" not in hf_compare.per_step(lambda n: None, steps=2, repeats=1, sync=lambda: None)


def test_the_schema_reads_json_of_the_tool(tmp_path):
    path = tmp_path / "x.json"
    doc = hf_compare.document(hf_compare.TOOL, {"device": "cpu"}, timings=[])
    path.write_text(json.dumps(doc))
    assert read(str(path))["tool"] == hf_compare.TOOL


def test_the_target_column_reads_the_ratio_of_compiled_full_to_static_reduce_overhead():
    """Rendering only (the CPU measures no compiled method): each shape's ratio and verdict."""

    def cell(model, method, ms):
        return {"model": model, "phase": "decode", "method": method, "batch_size": 1, "median_ms": ms,
                "min_ms": ms, "max_ms": ms, "samples_ms": [ms]}  # fmt: skip

    timings = [cell("a", "full+torch_compile/forward", 2.0), cell("a", "hf_static_ro/forward", 4.0)]
    timings += [cell("b", "full+torch_compile/forward", 3.0), cell("b", "hf_static_ro/forward", 2.0)]
    doc = hf_compare.document(hf_compare.TOOL, {"device": "cuda:0"}, timings=timings, ratios=hf_compare.ratios(timings))
    assert [(r["model"], r["median"]) for r in doc["ratios"]] == [("a", 0.5), ("b", 1.5)]
    rows = {line.split(" | ")[0]: line for line in make_docs_extra.hf_compare_tables(doc)[2].splitlines()[2:]}
    assert "| 0.500" in rows["| a"] and "| met |" in rows["| a"]
    assert "| 1.500" in rows["| b"] and "| **missed** |" in rows["| b"]


def test_the_bf16_forward_check_takes_two_kernels_rounding_and_flags_a_wrong_forward():
    import argparse
    import types

    import torch

    from cuda_graph_runner.reference.batches import eager_logits_fn
    from cuda_graph_runner.reference.models import hf

    adapter = hf.HFCausalLM.from_config(hf.builtin_config("llama"), dtype=torch.bfloat16, seed=0, std=0.15)
    adapter.create_kv_cache(num_slots=256, max_reqs=4, max_context_len=32)
    reference = hf_compare.hf_twin(adapter)  # sdpa: another attention kernel than our paged one
    args = argparse.Namespace(steps=1, repeats=1)
    eager = eager_logits_fn(adapter)
    prompt = list(range(3, 15))
    for runner, within in ((eager, True), (lambda batch: eager(batch).roll(1, -1), False)):
        cell = hf_compare.ours_forward(
            adapter, types.SimpleNamespace(forward=runner), prompt, args, lambda: None, reference
        )
        assert cell["within_tolerance"] is within, cell["max_abs_diff"]


def test_forward_only_measures_time_no_loop(tmp_path):
    out = tmp_path / "hf_compare.json"
    argv = ["--device", "cpu", "--shapes", "tiny", "--methods", "full,hf_eager,hf_static", "--measures", "forward"]
    assert hf_compare.main(argv + ["--prompt-len", "4", "--ragged", "2", "--iters", "1", "--out", str(out)]) == 0
    doc = read(str(out))
    assert {(t["method"], t["batch_size"]) for t in doc["timings"]} == {
        ("full/forward", 1), ("hf_eager/forward", 1), ("hf_static/forward", 1)
    }  # fmt: skip
    assert doc["settings"]["measures"] == ["forward"] and "generate()" not in " ".join(doc["notes"])
    assert [r["sizes"] for r in doc["runners"] if r["backend"] == "full"] == [[1]]


def test_hf_static_forward_takes_a_cache_slot_per_call_and_refuses_past_its_margin():
    # transformers' static cache appends at its own running length: the step fn sizes its
    # cache by calls, and one call too many is a clear error, not an out-of-bounds write.
    from cuda_graph_runner.testing import workload

    adapter = workload.HFCausalLM.from_config(workload.builtin_config("llama", size="tiny"), seed=0, std=0.15)
    model = hf_compare.hf_twin(adapter)
    prompt = [3, 5, 7, 9]
    step = hf_compare.hf_forward_fn(model, model.forward, prompt, margin=3)
    first = step()
    for _ in range(2):
        assert step().shape == first.shape
    with pytest.raises(RuntimeError, match="call 4 past the static cache's 3 decode slots"):
        step()


def test_the_docstring_s_cpu_smoke_run_is_accepted_as_written(monkeypatch):
    # The command after "CPU smoke run" in the module docstring, its flags through main's checks.
    doc = hf_compare.__doc__.split("CPU smoke run", 1)[1].split("::", 1)[1]
    command = " ".join(doc.strip().split("\n\n")[0].replace("\\\n", " ").split())
    words = shlex.split(command)
    assert words[:2] == ["python", "benchmarks/hf_compare.py"], words

    def stop(*args, **kwargs):
        raise KeyboardInterrupt  # the options were accepted: no need to run the cells

    monkeypatch.setattr(hf_compare, "run_shape", stop)
    with pytest.raises(KeyboardInterrupt):
        hf_compare.main(words[2:])
