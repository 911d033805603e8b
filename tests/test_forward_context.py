"""The forward context: the live batch and a scratch dict private to one forward."""

from __future__ import annotations

import pytest

from cuda_graph_runner.backend.context import forward_context, forward_scratch, get_forward_batch
from cuda_graph_runner.testing.toy_model import decode_batch


def test_each_block_has_its_own_scratch_and_batch():
    a, b = decode_batch(1), decode_batch(2)
    with forward_context(a):
        forward_scratch()["meta"] = 1
        with forward_context(b):  # nested: the inner forward sees neither a nor a's scratch
            assert get_forward_batch() is b and "meta" not in forward_scratch()
        assert get_forward_batch() is a and forward_scratch()["meta"] == 1
    with forward_context(a):  # the same batch again is a new forward: nothing carried over
        assert forward_scratch() == {}


def test_outside_any_block_errors_name_the_fix():
    with pytest.raises(RuntimeError, match="forward_context"):
        get_forward_batch()
    with pytest.raises(RuntimeError, match="forward_context"):
        forward_scratch()


def test_reference_model_releases_its_per_step_metadata_by_the_end_of_the_forward():
    import torch

    from cuda_graph_runner.reference.batches import GreedySession, make_decode_batch, make_dummy_prompts
    from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM

    model = ReferenceLlamaForCausalLM.from_preset("tiny")
    cache = model.create_kv_cache(num_slots=64, max_reqs=4, max_context_len=16)
    session = GreedySession(model, cache)
    session.prefill(make_dummy_prompts(2, 3, model.config.vocab_size))
    batch = make_decode_batch(cache, session.rows, None, [t[-1] for t in session.tokens])
    with torch.no_grad(), forward_context(batch):
        model.forward(batch)
        # Nothing allocated during the forward outlives it (CUDA-graph trees require it).
        assert forward_scratch() == {}
