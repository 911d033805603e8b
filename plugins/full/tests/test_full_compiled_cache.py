"""Compiled full's second start from the compile cache, on the CPU (the recording fake
graph module stands in for CUDA graphs; what is checked is the compiled forward): the
second start loads Dynamo's traced code (no frame traced, no FX or AOTAutograd lookup
missed) although the compile pass's batches are not marked dynamic then, and its
forward computes what the first start's did, within eager's tolerance.

One real inductor compile (~20 s on two cores); skipped without a C++ compiler."""

from __future__ import annotations

import itertools
import os
import shutil

import pytest
import torch

from cuda_graph_runner.backend import cache_counters, envs, forward_context
from cuda_graph_runner.testing.fakes import FakeGraphDeviceModule
from cuda_graph_runner.testing.tolerances import model_tolerance
from cuda_graph_runner.testing.workload import (
    DecodeCudaGraphRunner,
    GreedySession,
    ModelConfig,
    ReferenceLlamaForCausalLM,
    eager_logits_fn,
    make_decode_batch,
    make_dummy_prompts,
)
from cuda_graph_runner_full.backend import FullCudaGraphBackend

CONFIG = ModelConfig(num_hidden_layers=1)
TOL = model_tolerance(CONFIG, torch.float32, context_len=64)
CXX = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


def _start():
    from torch._dynamo.utils import counters

    model = ReferenceLlamaForCausalLM.from_config(CONFIG)
    model.create_kv_cache(num_slots=8 * 64 + 1, max_reqs=9, max_context_len=64)
    backend = FullCudaGraphBackend(
        "cpu", phase="decode", device_module=FakeGraphDeviceModule(), memory_pool="pool", compiler="inductor"
    )
    runner = DecodeCudaGraphRunner(model, {"decode": {"bs": [1, 2, 4]}}, device="cpu", backend=backend)
    runner.show_progress = False
    before, traced = cache_counters(), counters["stats"]["unique_graphs"]
    outputs = []
    with torch.no_grad():
        runner.capture()
        counts = {k: v - before[k] for k, v in cache_counters().items()}
        counts["traced"] = counters["stats"]["unique_graphs"] - traced
        for bs in (1, 3):
            session = GreedySession(model, model.kv_cache)
            session.prefill(make_dummy_prompts(bs, [3 + i for i in range(bs)], model.config.vocab_size, seed=bs))
            batch = make_decode_batch(model.kv_cache, session.rows, None, [t[-1] for t in session.tokens])
            key, static = runner.replay_prepare(batch)
            with runner.backend._compiled_active(), forward_context(static):
                got = runner.graph_forward(static)[:bs].clone()  # the compiled forward, padded shape
            torch.testing.assert_close(got, eager_logits_fn(model)(batch), **TOL, msg=f"bs {bs}")
            outputs.append(got)
            session.close()
    runner.cleanup()
    return counts, outputs


@pytest.mark.skipif(CXX is None, reason="inductor on the CPU needs a C++ compiler (g++ or $CXX); none found")
def test_second_start_loads_the_traced_code_and_computes_the_same(tmp_path, monkeypatch):
    import torch._dynamo.bytecode_transformation as bytecode_transformation

    monkeypatch.setenv(envs.CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(envs.COMPILE_CACHE_DYNAMO, raising=False)
    starts = []
    for _ in range(2):
        torch._dynamo.reset()
        # as in a fresh process: Dynamo's global-name counter from 0
        monkeypatch.setattr(bytecode_transformation, "_unique_id_counter", itertools.count())
        starts.append(_start())
    torch._dynamo.reset()
    (cold, cold_out), (warm, warm_out) = starts
    assert cold["dynamo_miss"] == 1 and cold["traced"] == 2, cold  # sizes >= 2, and size 1
    assert warm["dynamo_hit"] == 1 and warm["traced"] == 0, warm
    assert warm["fx_miss"] == 0 and warm["aot_miss"] == 0, warm
    for a, b in zip(cold_out, warm_out):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
