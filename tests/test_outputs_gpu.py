"""GPU: output lifetime with the ``full`` and ``breakable`` backends.

* ``owned_outputs=True``: an output kept from ``forward(batch of 3)`` is unchanged by a
  later ``forward(batch of 9)`` (another graph of the same pool) and by a replay of its
  own graph, and equals eager.
* The zero-copy default with the testing kit: ``GreedySession(decode_fn=runner.forward)``
  keeps logits equal to an eager session's (the kit copies what it keeps).
* Outputs carry no ``grad_fn`` when the caller forgets ``torch.no_grad()``.
"""

from __future__ import annotations

import pytest
import torch

from cuda_graph_runner.reference.batches import GreedySession, eager_logits_fn, make_dummy_prompts, make_extend_batch
from cuda_graph_runner.runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner
from cuda_graph_runner.testing.reference_setup import free_requests, prefilled_decode_batch, reference_model

pytestmark = pytest.mark.gpu

# fp32 tiny model: graph and eager differ only by reduction order.
ATOL = RTOL = 1e-4


@pytest.fixture(scope="module")
def fp32_model():
    return reference_model("tiny", requests=48)


def _decode_batch(model, bs: int, seed: int):
    """A live decode batch of ``bs`` requests (prompts prefilled eagerly) and its session."""
    prompts = make_dummy_prompts(bs, [3 + (i + seed) % 5 for i in range(bs)], model.config.vocab_size, seed=seed)
    return prefilled_decode_batch(model, prompts)


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_owned_outputs_survive_later_replays(fp32_model, backend):
    runner = DecodeCudaGraphRunner(
        fp32_model, {"decode": {"backend": backend, "max_bs": 16}}, owned_outputs=True, show_progress=False
    )
    assert runner.backend.name == backend and runner.owned_outputs
    runner.capture()
    eager = eager_logits_fn(fp32_model)
    s3, b3 = _decode_batch(fp32_model, 3, seed=1)
    s9, b9 = _decode_batch(fp32_model, 9, seed=2)
    s3b, b3b = _decode_batch(fp32_model, 3, seed=3)
    expected_a = eager(b3).clone()
    assert runner.can_run(b3) and runner.can_run(b9) and runner.can_run(b3b)
    # No torch.no_grad() here on purpose: the runner runs without autograd anyway.
    a = runner.forward(b3)
    assert a.grad_fn is None and not a.requires_grad
    snapshot = a.clone()
    runner.forward(b9)  # graph 12, same pool
    runner.forward(b3b)  # graph 4, a's own graph
    torch.cuda.synchronize()
    assert torch.equal(a, snapshot), f"{backend}: an owned output changed after later replays"
    torch.testing.assert_close(a, expected_a, atol=ATOL, rtol=RTOL)
    for s in (s3, s9, s3b):
        s.close()
    runner.cleanup()


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_greedy_session_logits_equal_eager_with_zero_copy_runner(fp32_model, backend):
    """The reported case: GreedySession(decode_fn=runner.forward) with the zero-copy
    default kept logits that later steps overwrote; the kit now copies them."""
    runner = DecodeCudaGraphRunner(fp32_model, {"decode": {"backend": backend, "max_bs": 16}}, show_progress=False)
    assert not runner.owned_outputs
    runner.capture()
    cache = fp32_model.kv_cache
    prompts = make_dummy_prompts(3, [5, 9, 4], fp32_model.config.vocab_size, seed=7)
    sessions = {}
    with torch.no_grad():
        for name, fn in (("eager", None), ("graph", runner.forward)):
            session = GreedySession(fp32_model, cache, decode_fn=fn)
            session.prefill(prompts)
            for _ in range(4):
                session.decode()
            sessions[name] = session
    torch.cuda.synchronize()
    eager, graph = sessions["eager"], sessions["graph"]
    assert graph.tokens == eager.tokens
    assert len(graph.logits) == len(eager.logits) == 5
    for step, (g, e) in enumerate(zip(graph.logits, eager.logits)):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL, msg=f"{backend}: step {step}")
    for session in sessions.values():
        session.close()
    runner.cleanup()


def test_breakable_prefill_owned_outputs_survive_later_replays(fp32_model):
    runner = PrefillCudaGraphRunner(
        fp32_model, {"prefill": {"backend": "breakable", "max_bs": 64}}, owned_outputs=True, show_progress=False
    )
    runner.capture()
    cache = fp32_model.kv_cache
    eager = eager_logits_fn(fp32_model)
    first = make_extend_batch(cache, make_dummy_prompts(3, [5, 9, 2], fp32_model.config.vocab_size, seed=11))
    second = make_extend_batch(cache, make_dummy_prompts(2, [20, 17], fp32_model.config.vocab_size, seed=12))
    with torch.no_grad():
        expected = eager(first).clone()
    assert runner.can_run(first) and runner.can_run(second)
    kept = runner.forward(first)
    snapshot = kept.clone()
    runner.forward(second)
    torch.cuda.synchronize()
    assert torch.equal(kept, snapshot)
    torch.testing.assert_close(kept, expected, atol=ATOL, rtol=RTOL)
    free_requests(cache, first, second)
    runner.cleanup()
