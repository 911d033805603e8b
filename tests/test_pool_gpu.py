"""GPU: the shared graph pool survives a runner cleaned up while a tensor of the pool is
still referenced (``bench`` with several backends in one process failed the next capture
with ``INTERNAL ASSERT FAILED ... use_count > 0``)."""

from __future__ import annotations

import pytest
import torch

from cuda_graph_runner.backend import pool
from cuda_graph_runner.reference.batches import eager_logits_fn, make_dummy_prompts, make_extend_batch
from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM
from cuda_graph_runner.runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_capture_again_after_every_graph_died_while_a_pool_tensor_lives():
    pool.reset_global_graph_memory_pools()
    x = torch.ones(1024, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool.get_global_graph_memory_pool("cuda")):
        kept = x * 2  # allocated in the pool, referenced after its graph dies
    g.replay()  # a capture records, it does not run: replay once so kept holds x * 2
    del g
    torch.cuda.synchronize()
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2, pool=pool.get_global_graph_memory_pool("cuda")):
        y = x + 1
    g2.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x + 1) and torch.equal(kept, x * 2)


@pytest.mark.parametrize("decode_backend", ["full", "breakable"])
def test_runners_one_after_another_with_a_kept_output(decode_backend):
    """What the bench does: runners captured, an output kept, every runner cleaned up;
    then a new runner captures on the same device."""
    model = ReferenceLlamaForCausalLM.from_preset("tiny", dtype=torch.float32, device="cuda")
    model.create_kv_cache(num_slots=8 * 64 + 1, max_reqs=9, max_context_len=64)
    config = {"decode": {"backend": decode_backend, "max_bs": 4}, "prefill": {"backend": "breakable", "max_bs": 64}}
    decode = DecodeCudaGraphRunner(model, config, show_progress=False)
    decode.capture()
    pool_before = decode.backend.memory_pool
    prompts = make_dummy_prompts(2, [5, 9], model.config.vocab_size, seed=0)
    batch = make_extend_batch(model.kv_cache, prompts)
    prefill = PrefillCudaGraphRunner(model, config, show_progress=False)
    prefill.capture()
    assert prefill.can_run(batch)
    kept = prefill.forward(batch)  # aliases pool memory (zero-copy default)
    snapshot = kept.clone()
    decode.cleanup()
    prefill.cleanup()  # no graph left: the pool is given back, the kept output stays valid
    assert decode.backend.memory_pool != pool_before
    again = PrefillCudaGraphRunner(model, config, show_progress=False)
    again.capture()
    with torch.no_grad():
        expected = eager_logits_fn(model)(batch).clone()
    got = again.forward(batch)
    torch.cuda.synchronize()
    assert torch.equal(kept, snapshot)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    again.cleanup()
