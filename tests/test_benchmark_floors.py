"""benchmarks/floors.py: the bytes and FLOPs behind the floor columns of benchmarks/run.py
(the rates themselves are measured on the device), and run.py's ``--prefill-requests``."""

from __future__ import annotations

import os
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

from floors import DeviceRates, decode_floor_ms, prefill_floor_ms, prefill_flops, weight_bytes  # noqa: E402

from cuda_graph_runner.reference.model import PRESETS, ReferenceLlamaForCausalLM  # noqa: E402


@pytest.fixture(scope="module")
def llama():
    return ReferenceLlamaForCausalLM(PRESETS["llama-3.2-1b"], dtype=torch.bfloat16, device="meta")


def test_llama_decode_reads_its_weights_once_plus_the_kv(llama):
    assert 2.46e9 < weight_bytes(llama) < 2.48e9  # 1.236 B parameters, the tied embedding once
    rates = DeviceRates(copy_gbps=4250.0, gemm_tflops=750.0)
    one = decode_floor_ms(llama, 1, 4096, rates)
    assert 0.58 < one < 0.62  # weights 0.58 ms + the K/V of 4096 keys (32 KiB a key over 16 layers) 0.03 ms
    assert decode_floor_ms(llama, 2, 4096, rates) - one == pytest.approx(4096 * 32768 / 4250e9 * 1e3)


def test_llama_prefill_flops_are_two_per_weight_per_token_plus_causal_attention(llama):
    flops = prefill_flops(llama, [512] * 4)
    assert 3.95e12 < flops < 4.15e12  # the 2048-token prefill: ~4.0 TFLOP
    one = prefill_flops(llama, [2048])  # one request: 4x the attention pairs
    attention_4 = 4 * 32 * 64 * 4 * (512 * 513 // 2) * 16
    assert one - flops == pytest.approx(4 * 32 * 64 * (2048 * 2049 // 2) * 16 - attention_4 - 2 * 3 * 128256 * 2048)
    assert prefill_floor_ms(llama, [512] * 4, DeviceRates(4250.0, 800.0)) == pytest.approx(flops / 800e12 * 1e3)


def test_prefill_requests_must_be_a_positive_integer(capsys):
    import run

    for bad in ("0", "x"):
        with pytest.raises(SystemExit):
            run.main(["--prefill-requests", bad, "--device", "cpu"])
        assert "--prefill-requests" in capsys.readouterr().err


def _cell(median, lo, hi, **more):
    return {"median_ms": median, "min_ms": lo, "max_ms": hi, "samples_ms": [lo, median, hi], **more}


def test_the_tables_show_the_floor_and_each_method_over_it_through_the_results_json(tmp_path):
    import json

    import make_docs

    from cuda_graph_runner.cli.results_schema import from_run_models, nested_view, read

    models = {
        "m": {
            "decode": {
                "1": {"eager": _cell(4.0, 3.0, 5.0), "full": _cell(1.0, 0.9, 1.1)},
                "2": {"full": _cell(1.2, 1, 2)},
            },
            "prefill": {"128": {"eager": _cell(3.0, 2.0, 4.0, requests=4), "breakable": _cell(1.5, 1, 2, requests=4)}},
            "prefill_by_requests": {"1": {"128": {"breakable": _cell(2.5, 2, 3, requests=1)}}},
            "prefill_requests": 4,
            "floor_ms": {
                "decode": {"1": 0.5},  # batch 2 has none: "-"
                "prefill": {"128": 0.25},
                "prefill_by_requests": {"1": {"128": 0.5}},
            },
            "device_rates": {"copy_gbps": 4200.0, "gemm_tflops": 800.0},
        }
    }
    path = tmp_path / "benchmarks.json"
    path.write_text(json.dumps(from_run_models(models, {"device": "cuda"})))
    doc = read(str(path))  # the schema holds the extra request count and the floors
    prefill = [t for t in doc["timings"] if t["phase"] == "prefill"]
    assert sorted((t["method"], t["requests"]) for t in prefill) == [("breakable", 1), ("breakable", 4), ("eager", 4)]
    view = nested_view(doc)["models"]["m"]
    assert view["prefill_by_requests"] == models["m"]["prefill_by_requests"] and set(view["prefill"]["128"]) == {
        "eager",
        "breakable",
    }
    text = make_docs.render(nested_view(doc))
    lines = text.splitlines()
    decode = lines[lines.index(next(x for x in lines if x.startswith("#### m: decode step"))) + 2]
    assert decode == "| batch | eager | full | floor | eager / floor | full / floor |"
    assert "| 1 | 4.000 [3.000-5.000] | 1.000 [0.900-1.100] | 0.500 | 8.00 [6.00-10.00] | 2.00 [1.80-2.20] |" in text
    assert "| 2 | - | 1.200 [1.000-2.000] | - | - | - |" in text
    assert "#### m: prefill, ms, 4 requests per batch (median [min-max]); floor: FLOPs" in text
    assert "| 128 | 3.000 [2.000-4.000] | 1.500 [1.000-2.000] | 0.250 | 12.00 [8.00-16.00] | 6.00 [4.00-8.00] |" in text
    assert "#### m: prefill, ms, 1 request per batch (median [min-max]); floor: FLOPs" in text
    assert "| 128 | 2.500 [2.000-3.000] | 0.500 | 5.00 [4.00-6.00] |" in text
    import make_docs_extra  # the docs page's prefill table (make_docs --results)

    table = make_docs_extra.prefill_table(doc)[0].splitlines()
    assert table[0] == "| model | tokens | eager | breakable | breakable / eager | floor | breakable / floor |"
    assert table[2] == "| m | 128 | 3.000 [2.000-4.000] | 1.500 [1.000-2.000] | 0.500 | 0.250 | 6.00 |"


def test_run_py_times_every_prefill_request_count_with_triton_attention(tmp_path, monkeypatch):
    """The harness on the CPU (eager only), the ``triton`` attention's kernels stood in by
    their torch model: each request count's prefill rows, in the schema and the tables."""
    import make_docs
    import run

    from cuda_graph_runner.cli.results_schema import nested_view, read
    from cuda_graph_runner.reference.model import paged_attention_model as pam
    from cuda_graph_runner.reference.model import triton_attention

    stand_in = pam.TorchKernels()
    monkeypatch.setattr(triton_attention, "_kernels", lambda: stand_in)
    monkeypatch.setattr(triton_attention, "triton_available", lambda: True)
    monkeypatch.setattr(triton_attention, "interpreting", lambda: True)
    argv = ["--device", "cpu", "--models", "tiny", "--batch-sizes", "1", "--quick", "--attention", "triton"]
    argv += ["--inductor-config", "default"]  # leaves the process-wide inductor config alone
    argv += ["--prefill-tokens", "4", "6", "--prefill-requests", "1", "2", "--backends", "breakable"]
    argv += ["--iters", "1", "--rounds", "1", "--warmup-min", "0", "--warmup-max", "1", "--warmup-min-s", "0"]
    assert run.main(argv + ["--out", str(tmp_path)]) == 0
    assert stand_in.calls > 0  # the triton backend's decode and extend ran
    doc = read(str(tmp_path / "benchmarks.json"))
    got = sorted((t["num_tokens"], t["requests"]) for t in doc["timings"] if t["phase"] == "prefill")
    assert got == [(4, 1), (4, 2), (6, 1), (6, 2)]
    view = nested_view(doc)["models"]["tiny"]
    assert set(view["prefill"]) == {"4", "6"} and set(view["prefill_by_requests"]["2"]) == {"4", "6"}
    text = make_docs.render(nested_view(doc))
    assert "prefill, ms, 1 request per batch" in text and "prefill, ms, 2 requests per batch" in text


def test_more_prefill_requests_than_the_smallest_token_count_are_refused(capsys):
    import run

    with pytest.raises(SystemExit):
        run.main(["--device", "cpu", "--prefill-tokens", "8", "3", "--prefill-requests", "1", "4"])
    assert "--prefill-requests 4: more requests than the smallest --prefill-tokens (3)" in capsys.readouterr().err
