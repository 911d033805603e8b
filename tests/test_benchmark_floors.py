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

from cuda_graph_runner.testing.model import PRESETS, ReferenceLlamaForCausalLM  # noqa: E402


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
