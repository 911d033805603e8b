"""GPU: the full backend replays the reference model exactly as eager runs it."""

from __future__ import annotations

import pytest
import torch

from cuda_graph_runner.testing.reference_setup import (
    assert_greedy_tokens_equal_eager,
    prefilled_decode_batch,
    reference_model,
    staggered_decode_case,
)
from cuda_graph_runner.testing.workload import DecodeCudaGraphRunner, eager_logits_fn, make_dummy_prompts

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def fp32_model():
    return reference_model("tiny", requests=40)


def test_runner_resolves_full_by_name_on_cuda(fp32_model):
    runner = DecodeCudaGraphRunner(fp32_model, {"decode": {"backend": "full", "max_bs": 2}})
    assert type(runner.backend).__name__ == "FullCudaGraphBackend"
    auto = DecodeCudaGraphRunner(fp32_model, {"decode": {"max_bs": 2}})
    assert auto.backend.name == "full"  # the default decode backend on CUDA


def test_every_size_on_and_off_the_buckets_equals_eager_fp32(fp32_model):
    runner = DecodeCudaGraphRunner(fp32_model, {"decode": {"backend": "full", "max_bs": 16}}, show_progress=False)
    runner.capture()
    assert runner.capture_sizes == [1, 2, 4, 8, 12, 16]
    for bs in sorted(set(runner.capture_sizes + [3, 5, 13, 16])):
        # a couple of steps so requests have different lengths
        session, batch, expected = staggered_decode_case(fp32_model, bs, seed=bs, decode_steps=2)
        with torch.no_grad():
            assert runner.can_run(batch)
            got = runner.forward(batch)
        assert got.shape == expected.shape == (bs, fp32_model.config.vocab_size)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=f"batch size {bs}")
        session.close()
    runner.cleanup()


def test_batch_above_max_bs_falls_back_to_eager(fp32_model):
    runner = DecodeCudaGraphRunner(fp32_model, {"decode": {"backend": "full", "max_bs": 4}}, show_progress=False)
    runner.capture()
    session, batch = prefilled_decode_batch(fp32_model, make_dummy_prompts(6, 5, fp32_model.config.vocab_size))
    with torch.no_grad():
        assert not runner.can_run(batch)
        torch.testing.assert_close(runner.forward(batch), eager_logits_fn(fp32_model)(batch))
    session.close()
    runner.cleanup()


@pytest.mark.parametrize("preset", ["llama-3.2-1b", "qwen2.5-0.5b"])
def test_bf16_greedy_tokens_equal_eager_over_16_steps(preset):
    model = reference_model(preset, requests=16, dtype=torch.bfloat16)
    runner = DecodeCudaGraphRunner(model, {"decode": {"backend": "full", "max_bs": 8}}, show_progress=False)
    runner.capture()
    assert_greedy_tokens_equal_eager(model, 16, decode_fn=runner.forward, what=preset)
    runner.cleanup()


def test_shapes_share_the_pool_largest_alone_bounds_the_total():
    """Outputs kept as aliases: all sizes together need about the largest size's memory."""
    from cuda_graph_runner.testing.workload import resolve_decode_backend

    model = reference_model("qwen2.5-0.5b", requests=64, dtype=torch.bfloat16, num_slots=65 * 64 + 1)
    sizes = {}
    for label, cfg in (
        ("all", {"backend": "full", "max_bs": 64}),
        ("alone", {"backend": "full", "bs": [64], "max_bs": 64}),
    ):
        backend = resolve_decode_backend(cfg, device="cuda", memory_pool=torch.cuda.graph_pool_handle())
        runner = DecodeCudaGraphRunner(model, {"decode": cfg}, backend=backend, show_progress=False)
        runner.capture()
        sizes[label] = runner.capture_memory_bytes
        if label == "all":
            # Every size still replays correctly with its outputs' blocks shared.
            for bs in (64, 1, 24, 3):
                session, batch = prefilled_decode_batch(
                    model, make_dummy_prompts(bs, 6, model.config.vocab_size, seed=bs)
                )
                with torch.no_grad():
                    expected = eager_logits_fn(model)(batch).clone()
                    torch.testing.assert_close(runner.forward(batch), expected, rtol=2e-2, atol=2e-2)
                session.close()
        runner.cleanup()
    assert sizes["alone"] > 0
    assert sizes["all"] <= 1.5 * sizes["alone"], sizes
