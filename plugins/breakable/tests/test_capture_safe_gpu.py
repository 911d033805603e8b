"""GPU: backend ``breakable`` with the reference attention recorded inside the segments in
decode (declared capture-safe for the fixed-width modes).

* every decode (and target-verify) shape is one CUDA graph, no eager break; prefill
  shapes still break at every attention;
* replay equals eager (fp32, tight tolerance) on captured and padded batch sizes over
  several steps, with the step's K/V written at the live slots; the same with the
  capture-safe path turned off (one break per layer), as the control;
* bf16 presets (``llama-3.2-1b``, ``qwen2.5-0.5b``): greedy tokens over 16 steps equal
  eager's, as ``full``'s do (tests/test_full_gpu.py).

Run on the device machine: ``python -m pytest plugins/breakable/tests/test_capture_safe_gpu.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cuda_graph_runner.testing.reference_setup import assert_greedy_tokens_equal_eager, reference_model
from cuda_graph_runner.testing.workload import (
    DecodeCudaGraphRunner,
    GreedySession,
    PrefillCudaGraphRunner,
    eager_logits_fn,
    make_decode_batch,
    make_dummy_prompts,
)

pytestmark = pytest.mark.gpu

ATTN = "reference_llama_attention"
CONTEXT = 96


def make_backend(phase: str, **kwargs: Any):
    from cuda_graph_runner_breakable.backend import BreakableCudaGraphBackend

    device = torch.device("cuda", torch.cuda.current_device())
    # A pool of its own, so the graph memory of one test never hides in another's.
    return BreakableCudaGraphBackend(str(device), phase=phase, memory_pool=torch.cuda.graph_pool_handle(), **kwargs)


@pytest.fixture(scope="module")
def fp32_model():
    return reference_model("tiny", requests=40, context=CONTEXT)


def all_kv(cache, slots: torch.Tensor):
    return [buf[slots].clone() for buf in cache.k_buffers + cache.v_buffers]


@pytest.mark.parametrize("inline", [True, False], ids=["capture-safe", "breaks"])
@pytest.mark.parametrize("width", [1, 3], ids=["decode", "verify3"])
def test_decode_replay_equals_eager_on_captured_and_padded_sizes(fp32_model, inline, width):
    model, cache = fp32_model, fp32_model.kv_cache
    layers, V = model.config.num_hidden_layers, model.config.vocab_size
    mode = "decode" if width == 1 else "target_verify"
    runner = DecodeCudaGraphRunner(
        model,
        {"decode": {"max_bs": 16}},
        mode=mode,
        num_tokens_per_req=width,
        backend=make_backend("decode", inline_capture_safe_ops=inline),
        show_progress=False,
    )
    eager = eager_logits_fn(model)
    try:
        with torch.no_grad():
            runner.capture()
        assert {1, 4, 16} <= set(runner.capture_sizes) and 3 not in runner.capture_sizes
        for key in runner.backend.captured_keys:
            graph = runner.backend.graph(key)
            if inline:
                assert len(graph.segments) == 1 and graph.breaks == [] and graph.inlined == [ATTN] * layers, key
            else:
                assert len(graph.segments) == layers + 1 and graph.op_names == [ATTN] * layers, key
        replays = 0
        for bs in (1, 2, 3, 5, 8, 11, 16):  # 3, 5, 11 are padded
            session = GreedySession(model, cache)
            with torch.no_grad():
                session.prefill(make_dummy_prompts(bs, [3 + (7 * i) % 13 for i in range(bs)], V, seed=bs))
                last = [t[-1] for t in session.tokens]
                for step in range(3):
                    tokens = [[t] + [(t + j) % V for j in range(1, width)] for t in last] if width > 1 else last
                    batch = make_decode_batch(cache, session.rows, None, tokens)
                    expected = eager(batch).clone()
                    kv_expected = all_kv(cache, batch.out_cache_loc)
                    for buf in cache.k_buffers + cache.v_buffers:
                        buf[batch.out_cache_loc] = 0  # the graph must write them again, at the live slots
                    assert runner.can_run(batch)
                    got = runner.forward(batch).clone()
                    replays += 1
                    assert got.shape == expected.shape == (bs * width, V)
                    torch.testing.assert_close(
                        got, expected, atol=1e-4, rtol=1e-4, msg=lambda m: f"bs {bs} step {step}: {m}"
                    )
                    for i, (g, e) in enumerate(zip(all_kv(cache, batch.out_cache_loc), kv_expected)):
                        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4, msg=lambda m: f"KV {i}, bs {bs}: {m}")
                    last = got.view(bs, width, V)[:, -1].argmax(-1).tolist()
            session.close()
        assert runner.backend.num_replays == replays
    finally:
        runner.cleanup()


def test_prefill_still_breaks_at_every_attention(fp32_model):
    layers = fp32_model.config.num_hidden_layers
    runner = PrefillCudaGraphRunner(
        fp32_model, {"prefill": {"max_bs": 64}}, backend=make_backend("prefill"), show_progress=False
    )
    try:
        with torch.no_grad():
            runner.capture()
        for key in runner.backend.captured_keys:
            graph = runner.backend.graph(key)
            assert len(graph.segments) == layers + 1 and graph.op_names == [ATTN] * layers and graph.inlined == []
    finally:
        runner.cleanup()


@pytest.mark.parametrize("preset", ["llama-3.2-1b", "qwen2.5-0.5b"])
def test_bf16_greedy_tokens_equal_eager_over_16_steps(preset):
    model = reference_model(preset, requests=16, dtype=torch.bfloat16)
    runner = DecodeCudaGraphRunner(
        model, {"decode": {"max_bs": 8}}, backend=make_backend("decode"), show_progress=False
    )
    try:
        with torch.no_grad():
            runner.capture()
        assert all(len(runner.backend.graph(k).segments) == 1 for k in runner.backend.captured_keys)
        assert_greedy_tokens_equal_eager(model, 16, decode_fn=runner.forward, what=preset)
    finally:
        runner.cleanup()
