"""End to end on a CUDA device: greedy generation with prefill=breakable and decode=full
gives the same tokens (and logits) as eager.

Both backends are selected by name through the registry, as an engine would, so the
``cuda-graph-runner-breakable`` and ``cuda-graph-runner-full`` distributions must be
installed. Run on the device machine: ``python -m pytest tests/test_generation_gpu.py``.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import pytest
import torch

from cuda_graph_runner.reference.batches import GreedySession, make_dummy_prompts
from cuda_graph_runner.reference.model import PRESETS, ReferenceLlamaForCausalLM
from cuda_graph_runner.runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
CONFIG = {"prefill": {"backend": "breakable", "max_bs": 512}, "decode": {"backend": "full", "max_bs": 16}}
STEPS = 16


def make_model() -> ReferenceLlamaForCausalLM:
    # std 0.1 spreads the logits, so greedy picks are far from ties.
    model = ReferenceLlamaForCausalLM.from_config(PRESETS["tiny"], dtype=torch.float32, device=DEVICE, std=0.1)
    model.create_kv_cache(num_slots=16384, max_reqs=64, max_context_len=256)
    return model


def generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    prefill_fn: Optional[Callable] = None,
    decode_fn: Optional[Callable] = None,
    chunk_size: Optional[int] = None,
) -> Tuple[List[List[int]], List[torch.Tensor]]:
    """Greedy tokens and the per-step logits they were picked from (copies)."""

    def copied(fn: Optional[Callable]) -> Optional[Callable]:
        # Runner outputs may live in graph memory that the next replay overwrites.
        return None if fn is None else (lambda batch: fn(batch).clone())

    session = GreedySession(model, model.kv_cache, prefill_fn=copied(prefill_fn), decode_fn=copied(decode_fn))
    try:
        with torch.no_grad():
            session.prefill(prompts, chunk_size=chunk_size)
            for _ in range(STEPS - 1):
                session.decode()
        return session.tokens, [l.clone() for l in session.logits]
    finally:
        session.close()


class Counting:
    """Wraps a runner's forward, counting the batches that replayed a graph."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.replays = 0
        self.calls = 0

    def __call__(self, batch: Any) -> torch.Tensor:
        self.calls += 1
        self.replays += bool(self.runner.can_run(batch))
        return self.runner.forward(batch)


@pytest.fixture(scope="module")
def setup():
    model = make_model()
    prefill = PrefillCudaGraphRunner(model, CONFIG, show_progress=False)
    decode = DecodeCudaGraphRunner(model, CONFIG, show_progress=False)
    assert prefill.backend.name == "breakable" and decode.backend.name == "full"
    with torch.no_grad():
        prefill.capture()
        decode.capture()
    yield model, prefill, decode
    decode.cleanup()
    prefill.cleanup()


def assert_same_generation(eager: Tuple[list, list], graph: Tuple[list, list]) -> None:
    tokens_e, logits_e = eager
    tokens_g, logits_g = graph
    assert len(logits_g) == len(logits_e) == STEPS
    for step, (g, e) in enumerate(zip(logits_g, logits_e)):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
    assert tokens_g == tokens_e


@pytest.mark.parametrize("chunk_size", [None, 16], ids=["whole-prompts", "chunked-16"])
def test_greedy_tokens_match_eager(setup, chunk_size):
    model, prefill, decode = setup
    prompts = make_dummy_prompts(5, [30, 50, 10, 70, 3], model.config.vocab_size, seed=0)  # 163 tokens -> 176
    eager = generate(model, prompts, chunk_size=chunk_size)
    prefill_fn, decode_fn = Counting(prefill), Counting(decode)
    graph = generate(model, prompts, prefill_fn=prefill_fn, decode_fn=decode_fn, chunk_size=chunk_size)
    assert_same_generation(eager, graph)
    assert prefill_fn.replays >= 1 and decode_fn.replays == decode_fn.calls == STEPS - 1


def test_default_prefill_backend_on_cuda_is_breakable(setup):
    model, _, _ = setup
    runner = PrefillCudaGraphRunner(model, {"prefill": {"max_bs": 16}}, show_progress=False)
    assert runner.backend.name == "breakable"
