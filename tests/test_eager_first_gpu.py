"""GPU: the ``eager_first`` capture policy with real CUDA graphs (``full``, compiled full,
``breakable``): decode steps served eagerly from the first one, sizes switched to replay
one capture step at a time with verify mode on (every replay checked against eager), the
outputs equal to eager before and after each switch, and no capture step touching a live
request's KV slots; prefill likewise."""

from __future__ import annotations

import pytest
import torch

from cuda_graph_runner.reference.batches import eager_logits_fn, make_dummy_prompts, make_extend_batch
from cuda_graph_runner.runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner
from cuda_graph_runner.runner.stats import REASON_NOT_CAPTURED_YET
from cuda_graph_runner.testing.reference_setup import reference_model, staggered_decode_case
from cuda_graph_runner.testing.tolerances import model_tolerance

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

#: A budget no size fits in: every capture_step captures exactly one size.
ONE_SIZE = 1e-6

DECODE_BACKENDS = {
    "full": {"backend": "full"},
    "full+torch_compile": {"backend": "full", "torch_compile": True},
    "breakable": {"backend": "breakable"},
}


def _kv_snapshot(cache):
    """The live part of the cache: every slot but the reserved 0, every row but 0."""
    return (
        [k[1:].clone() for k in cache.k_buffers],
        [v[1:].clone() for v in cache.v_buffers],
        cache.req_to_token[1:].clone(),
    )


def _assert_kv_unchanged(cache, snapshot, where):
    ks, vs, rows = snapshot
    for layer in range(len(ks)):
        assert torch.equal(cache.k_buffers[layer][1:], ks[layer]), f"{where}: K of layer {layer} changed"
        assert torch.equal(cache.v_buffers[layer][1:], vs[layer]), f"{where}: V of layer {layer} changed"
    assert torch.equal(cache.req_to_token[1:], rows), f"{where}: req_to_token changed"


@pytest.mark.parametrize("label", sorted(DECODE_BACKENDS))
def test_decode_switch_over_equals_eager_with_verify_on(label):
    sizes = [1, 2, 4] if label != "full+torch_compile" else [1, 2]  # compiling costs seconds per size
    model = reference_model("tiny", requests=max(sizes) * 2, context=64, dtype=torch.float32, device="cuda")
    config = {"decode": {**DECODE_BACKENDS[label], "bs": sizes, "capture": "eager_first", "verify": True}}
    config["decode"]["verify_first_n"] = 1000  # every replay of the switch-over checked
    runner = DecodeCudaGraphRunner(model, config, show_progress=False)
    tol = model_tolerance(model, torch.float32, context_len=64)
    atol, rtol = runner.backend.verify_tolerance(torch.float32)  # compiled full: its wider one
    tol = {"atol": max(tol["atol"], float(atol)), "rtol": max(tol["rtol"], float(rtol))}
    with torch.no_grad():
        assert runner.capture().sizes == []  # returns at once
        cases = [staggered_decode_case(model, bs, seed=bs) for bs in sizes]
        captured: set = set()
        for round_ in range(len(sizes) + 1):
            for (_, batch, expected), bs in zip(cases, sizes):
                replays = runner.stats.replays_by_size[bs]
                got = runner.forward(batch)
                torch.testing.assert_close(got, expected, **tol, msg=lambda m: f"{label} bs {bs}, round {round_}: {m}")
                assert runner.stats.replays_by_size[bs] == replays + (bs in captured), (label, bs, round_)
            snapshot = _kv_snapshot(model.kv_cache)
            step = runner.capture_step(ONE_SIZE)
            torch.cuda.synchronize()
            _assert_kv_unchanged(model.kv_cache, snapshot, f"{label} capture step {round_}")
            captured.update(step.sizes)
            assert step.ready == len(captured) and len(step.sizes) == (1 if round_ < len(sizes) else 0)
        for session, _, _ in cases:
            session.close()
    stats = runner.run_stats()
    assert stats["eager_fallbacks"][REASON_NOT_CAPTURED_YET] > 0
    assert stats["capture"]["ready"] == len(sizes) and stats["capture"]["pending"] == 0
    assert len(runner.verifier.checked) > 0
    runner.cleanup()


def test_prefill_eager_first_replays_equal_eager():
    model = reference_model("tiny", requests=8, context=64, dtype=torch.float32, device="cuda")
    config = {"prefill": {"backend": "breakable", "bs": [16, 32, 64], "capture": "eager_first", "verify": True}}
    runner = PrefillCudaGraphRunner(model, config, show_progress=False)
    eager = eager_logits_fn(model)
    tol = model_tolerance(model, torch.float32, context_len=64)
    with torch.no_grad():
        runner.capture()
        for step in range(4):
            prompts = make_dummy_prompts(2, [5 + step, 20], model.config.vocab_size, seed=step)
            batch = make_extend_batch(model.kv_cache, prompts)
            expected = eager(batch).clone()
            torch.testing.assert_close(runner.forward(batch), expected, **tol)
            for row in batch.req_pool_indices.tolist():
                model.kv_cache.free_request(row)
            runner.capture_step(ONE_SIZE)
    stats = runner.run_stats()
    assert stats["replays"] >= 1 and stats["eager_fallbacks"].get(REASON_NOT_CAPTURED_YET, 0) >= 1
    runner.cleanup()
