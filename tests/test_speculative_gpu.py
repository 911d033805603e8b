"""GPU: speculative decoding with CUDA graphs in float32, TF32 off: the loop's greedy tokens
equal plain greedy decoding's (through a DECODE graph) exactly, for ragged prompts and
requests finishing at different rounds, k = 1..5 (oracle draft), and with the target as
its own draft through the draft runner's k-step graph (``full``, ``breakable``, compiled
full); the draft graph gives eager's tokens. A divergence fails with its request, step and
the target's top-2 logit gap.

Run on the device machine: ``pytest -m gpu tests/test_speculative_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from cuda_graph_runner.config import CudaGraphConfig
from cuda_graph_runner.reference.batches import (
    GreedySession,
    eager_logits_fn,
    greedy_generate,
    make_dummy_prompts,
    make_extend_batch,
)
from cuda_graph_runner.reference.speculative import (
    ModelDraft,
    OracleDraft,
    SpeculativeStats,
    layer_skip_draft,
    make_draft_batch,
    speculative_generate,
)
from cuda_graph_runner.runner import DecodeCudaGraphRunner
from cuda_graph_runner.runner.draft import DraftDecodeCudaGraphRunner, draft_steps
from cuda_graph_runner.testing.reference_setup import reference_model, staggered_lengths

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device"),
]

REQUESTS, CONTEXT = 6, 96
BUDGETS = [5, 33, 12, 40, 21, 2]
PHASES = {
    "full": {"backend": "full"},
    "breakable": {"backend": "breakable"},
    "full+torch_compile": {"backend": "full", "torch_compile": True},
}


@pytest.fixture(scope="module", autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _config(phase="full"):
    return CudaGraphConfig.from_dict({"decode": {**PHASES[phase], "bs": [1, 2, 4, 6]}})


@pytest.fixture(scope="module")
def target():
    return reference_model("tiny", requests=REQUESTS, context=CONTEXT, device="cuda")


@pytest.fixture(scope="module")
def case(target):
    """Prompts and plain greedy decoding's tokens through a DECODE graph, with its logits."""
    prompts = make_dummy_prompts(REQUESTS, staggered_lengths(REQUESTS, 6, 7), target.config.vocab_size, seed=11)
    runner = DecodeCudaGraphRunner(target, _config(), show_progress=False)
    runner.capture()
    session = GreedySession(target, target.kv_cache, decode_fn=runner.forward)
    with torch.no_grad():
        session.prefill(prompts)
        for _ in range(max(BUDGETS) - 1):
            session.decode()
    tokens, logits = session.tokens, session.logits
    session.close()
    return prompts, [t[:b] for t, b in zip(tokens, BUDGETS)], logits


def _assert_lossless(got, expected, logits):
    for i, (g, e) in enumerate(zip(got, expected)):
        for step, (a, b) in enumerate(zip(g, e)):
            if a != b:
                top2 = logits[step][i].topk(2).values
                pytest.fail(
                    f"request {i} step {step}: {a} != {b}; plain decode's top-2 logit gap {float(top2[0] - top2[1]):.3g}"
                )
        assert len(g) == len(e)


def _verify_runner(target, k):
    runner = DecodeCudaGraphRunner(
        target, _config(), mode="target_verify", num_tokens_per_req=k + 1, show_progress=False
    )
    runner.capture()
    return runner


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_oracle_draft_is_lossless(target, case, k):
    prompts, expected, logits = case
    runner = _verify_runner(target, k)
    stats = SpeculativeStats()
    got = speculative_generate(
        target, prompts, BUDGETS, OracleDraft(expected), k, verify_fn=runner.forward, stats=stats
    )
    _assert_lossless(got, expected, logits)
    assert not runner.stats.fallbacks and stats.rounds == max(-(-(b - 1) // (k + 1)) for b in BUDGETS)


@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("k", [2, 4])
def test_target_as_its_own_draft_through_the_draft_graph_is_lossless(target, case, phase, k):
    prompts, expected, logits = case
    draft_model = reference_model("tiny", requests=REQUESTS, context=CONTEXT, device="cuda")
    draft_runner = DraftDecodeCudaGraphRunner(draft_model, _config(phase), num_steps=k, show_progress=False)
    extend_runner = DecodeCudaGraphRunner(draft_model, _config(phase), show_progress=False)
    draft_runner.capture()
    extend_runner.capture()
    stats = SpeculativeStats()
    draft = ModelDraft(draft_model, draft_fn=draft_runner.forward, extend_fn=extend_runner.forward)
    got = speculative_generate(
        target, prompts, BUDGETS, draft, k, verify_fn=_verify_runner(target, k).forward, stats=stats
    )
    _assert_lossless(got, expected, logits)
    assert stats.accept_rate == 1.0 and not draft_runner.stats.fallbacks


def test_layer_skip_draft_is_lossless(target, case):
    prompts, expected, logits = case
    draft_model = layer_skip_draft(target, 1, requests=REQUESTS, context=CONTEXT)
    draft_runner = DraftDecodeCudaGraphRunner(draft_model, _config(), num_steps=3, show_progress=False)
    draft_runner.capture()
    stats = SpeculativeStats()
    draft = ModelDraft(draft_model, draft_fn=draft_runner.forward)
    got = speculative_generate(
        target, prompts, BUDGETS, draft, 3, verify_fn=_verify_runner(target, 3).forward, stats=stats
    )
    _assert_lossless(got, expected, logits)
    assert stats.accepted < stats.proposed


@pytest.mark.parametrize("phase", list(PHASES))
def test_draft_graph_equals_eager_steps(target, phase):
    k = 4
    draft_model = layer_skip_draft(target, 1, requests=REQUESTS, context=CONTEXT)
    runner = DraftDecodeCudaGraphRunner(draft_model, _config(phase), num_steps=k, show_progress=False)
    runner.capture()
    cache = draft_model.kv_cache
    prompts = make_dummy_prompts(5, [4, 19, 7, 11, 30], target.config.vocab_size, seed=5)  # pads to the size-6 graph
    with torch.no_grad():
        prefill = make_extend_batch(cache, prompts)
        eager_logits_fn(draft_model)(prefill)
        batch = make_draft_batch(cache, prefill.req_pool_indices.tolist(), [p[-1] for p in prompts], k)
        expected = draft_steps(draft_model, batch, k).clone()
        got = runner.forward(batch).clone()
    torch.cuda.synchronize()
    assert torch.equal(got, expected) and runner.stats.replays_by_size == {5: 1}
    for r in prefill.req_pool_indices.tolist():
        cache.free_request(r)


def test_a_round_synchronizes_the_host_with_the_device_once(target):
    # torch's sync debug mode warns at every host-device synchronization (a read, a
    # pageable copy): with the runners' forwards left out, two runs whose round counts
    # differ must differ by exactly that many synchronizations (prefill's are the same).
    import warnings

    prompts = make_dummy_prompts(4, staggered_lengths(4), target.config.vocab_size, seed=5)
    eager = eager_logits_fn(target)

    def unwatched(fn):
        def run(batch):
            torch.cuda.set_sync_debug_mode(0)
            try:
                return fn(batch)
            finally:
                torch.cuda.set_sync_debug_mode(1)

        return run

    counts = []
    for budget in (9, 41):
        plain = greedy_generate(target, target.kv_cache, prompts, budget)
        stats = SpeculativeStats()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(1)
            try:
                got = speculative_generate(
                    target, prompts, budget, OracleDraft(plain), 3, verify_fn=unwatched(eager), stats=stats
                )
            finally:
                torch.cuda.set_sync_debug_mode(0)
        assert len(got) == len(prompts)
        syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
        counts.append((stats.rounds, len(syncs)))
    (rounds_a, syncs_a), (rounds_b, syncs_b) = counts
    assert rounds_b > rounds_a and syncs_b - syncs_a == rounds_b - rounds_a, counts
