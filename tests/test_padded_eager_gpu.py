"""GPU: with ``padded_eager`` an eager runner's outputs equal a replaying runner's bitwise in
bfloat16 (the llama-3.2-1b shape, random weights): decode through ``full`` and prefill
through ``breakable`` against backend ``disabled`` with the key on. Without the key the
eager forward runs the live shapes (other GEMM shapes), and the test prints how far those
logits are from the replay's, for the record (not asserted: they may or may not differ).

Run on the device machine: ``pytest -m gpu tests/test_padded_eager_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from cuda_graph_runner.reference.batches import GreedySession, make_decode_batch, make_dummy_prompts, make_extend_batch
from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM
from cuda_graph_runner.runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the bf16 bitwise check needs a CUDA device"),
]


@pytest.fixture(scope="module")
def model():
    m = ReferenceLlamaForCausalLM.from_preset("llama-3.2-1b", dtype=torch.bfloat16, device="cuda")
    m.create_kv_cache(num_slots=16 * 256 + 1, max_reqs=17, max_context_len=256)
    return m


def test_decode_padded_eager_equals_full_replay_bitwise_in_bf16(model):
    phase = {"max_bs": 16}
    graphs = DecodeCudaGraphRunner(model, {"decode": {"backend": "full", **phase}}, show_progress=False)
    padded = DecodeCudaGraphRunner(model, {"decode": {"backend": "disabled", "padded_eager": True, **phase}})
    live = DecodeCudaGraphRunner(model, {"decode": {"backend": "disabled", **phase}})
    graphs.capture()
    for bs in (3, 5, 7, 13):
        session = GreedySession(model, model.kv_cache)
        try:
            with torch.no_grad():
                session.prefill(
                    make_dummy_prompts(bs, [9 + 5 * i for i in range(bs)], model.config.vocab_size, seed=bs)
                )
                batch = make_decode_batch(model.kv_cache, session.rows, None, [t[-1] for t in session.tokens])
                replayed = graphs.forward(batch).clone()
                got = padded.forward(batch).clone()
                plain = live.forward(batch)
            assert graphs.padded_size(bs) > bs
            assert torch.equal(got, replayed), f"bs {bs}: max diff {(got - replayed).abs().max().item()}"
            print(f"bs {bs}: live-size eager max |diff| {(plain - replayed).abs().max().item():.3g}")
        finally:
            session.close()
    assert graphs.run_stats()["replays"] == 4 and padded.run_stats()["eager_total"] == 4


def test_prefill_padded_eager_equals_breakable_replay_bitwise_in_bf16(model):
    phase = {"max_bs": 512}
    graphs = PrefillCudaGraphRunner(model, {"prefill": {"backend": "breakable", **phase}}, show_progress=False)
    padded = PrefillCudaGraphRunner(model, {"prefill": {"backend": "disabled", "padded_eager": True, **phase}})
    graphs.capture()
    cache = model.kv_cache
    for lens in ([50, 70], [13, 100, 180]):
        batch = make_extend_batch(cache, make_dummy_prompts(len(lens), lens, model.config.vocab_size, seed=len(lens)))
        try:
            with torch.no_grad():
                replayed = graphs.forward(batch).clone()
                got = padded.forward(batch)
            assert graphs.padded_size(sum(lens)) > sum(lens)
            assert torch.equal(got, replayed), f"{lens}: max diff {(got - replayed).abs().max().item()}"
        finally:
            for row in batch.req_pool_indices.tolist():
                cache.free_request(row)
    assert graphs.run_stats()["replays"] == 2
