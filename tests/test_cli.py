"""The ``cuda-graph-runner`` command on a machine without CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from cuda_graph_runner.cli.command import main

needs_no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the CPU-only behaviour; this machine has CUDA"
)


@needs_no_cuda
def test_backends_table_shows_full_unavailable_with_reason(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.split()[0] == "full")
    assert "cuda-graph-runner-full" in line and "unavailable" in line and "without CUDA" in line
    assert main(["backends", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["disabled"]["status"] == "available"


@needs_no_cuda
def test_bench_runs_eagerly_and_says_why(tmp_path, capsys):
    path = tmp_path / "bench.json"
    args = (
        "bench --batch-sizes 1 2 --prefill-tokens 8 --prefill-requests 2 --iters 1 --warmup 0 --steps 2 --prompt-len 4"
    )
    code = main([*args.split(), "--json", str(path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "running eager only" in out and "full: runs on cuda, not on cpu" in out  # the bench device's reason
    data = json.loads(path.read_text())  # the results schema: eager-only timings
    decode = [t for t in data["timings"] if t["phase"] == "decode"]
    assert [t["batch_size"] for t in decode] == [1, 2]
    assert all(t["method"] == "eager" and t["median_ms"] > 0 and "eager_ms" not in t for t in decode)
    [prefill] = [t for t in data["timings"] if t["phase"] == "prefill"]
    assert prefill["num_tokens"] == 8 and data["env"]["model"] == "tiny"


def test_bench_rejects_unknown_model_naming_presets(capsys):
    assert main(["bench", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "llama-3.2-1b" in err


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--cuda-graph-config", '{"decode": {"bs": [16], "compile_sizes": [8]}}'], "decode.compile_sizes=[8]"),
        (["--cuda-graph-max-bs-decode", "zero"], "zero"),
    ],
)
def test_bench_config_errors_exit_2_naming_the_value(flags, named, capsys):
    with pytest.raises(SystemExit) as info:  # argparse rejects the flag before any work
        main(["bench", *flags])
    assert info.value.code == 2
    assert named in capsys.readouterr().err


def test_backends_check_imports_classes_and_reports_contract(capsys):
    assert main(["backends", "--check"]) == 0
    out = capsys.readouterr().out
    assert "contract" in out.splitlines()[0]
    full = next(l for l in out.splitlines() if l.split()[0] == "full")
    assert " ok " in f" {full} " or "not checked" in full
