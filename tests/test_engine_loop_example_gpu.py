"""GPU: examples/engine_loop.py with the CUDA defaults (``full`` decode, ``breakable``
prefill): in float32 its tokens equal an eager run of the same schedule; in bfloat16 with
``padded_eager`` (the llama-3.2-1b shape) its tokens, and every kept logit, equal the
eager run's bitwise.

Run on the device machine: ``pytest -m gpu tests/test_engine_loop_example_gpu.py``.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the example's graphs need a CUDA device"),
]

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "engine_loop.py"


def _load():
    spec = importlib.util.spec_from_file_location("engine_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


engine_loop = _load()
SHAPE = dict(max_running=8, chunk_size=16, prefill_token_budget=64)
EAGER = dict(decode_backend="disabled", prefill_backend="disabled")


def test_fp32_tokens_equal_an_eager_run_of_the_same_schedule():
    model = ReferenceLlamaForCausalLM.from_preset("tiny", dtype=torch.float32, device="cuda")
    requests = engine_loop.workload(12, model.config.vocab_size, temperature=0.8, seed=1)
    graphs, stats = engine_loop.run_engine(model, requests, **SHAPE)
    eager, _ = engine_loop.run_engine(model, requests, **EAGER, **SHAPE)
    assert [r.output for r in graphs] == [r.output for r in eager]
    assert stats.decode_runner["replays"] > 0 and stats.prefill_runner["replays"] > 0
    print("\n".join(stats.lines()))


def test_bf16_padded_eager_gives_bitwise_equal_tokens_and_logits():
    model = ReferenceLlamaForCausalLM.from_preset("llama-3.2-1b", dtype=torch.bfloat16, device="cuda")
    requests = engine_loop.workload(12, model.config.vocab_size, temperature=0.8, seed=2)
    run = dict(padded_eager=True, keep_logits=True, **SHAPE)
    graphs, stats = engine_loop.run_engine(model, requests, **run)
    eager, _ = engine_loop.run_engine(model, requests, **EAGER, **run)
    assert [r.output for r in graphs] == [r.output for r in eager]
    for g, e in zip(graphs, eager):
        assert all(torch.equal(a, b) for a, b in zip(g.logits, e.logits)), f"request {g.rid}"
    assert stats.decode_runner["replays"] > 0 and stats.prefill_runner["replays"] > 0
    print("\n".join(stats.lines()))
