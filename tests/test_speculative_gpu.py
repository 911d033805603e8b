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
from cuda_graph_runner.runner import DecodeCudaGraphRunner, GreedyDecodeCudaGraphRunner
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
    draft = ModelDraft(
        draft_model, draft_fn=draft_runner.forward, extend_fn=extend_runner.forward, read_between_proposes=True
    )
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
    draft = ModelDraft(draft_model, draft_fn=draft_runner.forward, read_between_proposes=True)
    got = speculative_generate(
        target, prompts, BUDGETS, draft, 3, verify_fn=_verify_runner(target, 3).forward, stats=stats
    )
    _assert_lossless(got, expected, logits)
    assert stats.accepted < stats.proposed


@pytest.mark.parametrize("draft_name", ["oracle", "layer-skip"])
def test_a_verify_graph_that_records_the_argmax_is_lossless(target, case, draft_name):
    # GreedyDecodeCudaGraphRunner's verify returns tokens: host drafts judged on them as
    # read, device drafts (the draft graph's) next to them, rejections rolled back.
    prompts, expected, logits = case
    k = 3
    runner = GreedyDecodeCudaGraphRunner(
        target, _config(), mode="target_verify", num_tokens_per_req=k + 1, show_progress=False
    )
    runner.capture()
    if draft_name == "oracle":
        draft = OracleDraft(expected)
    else:
        draft_model = layer_skip_draft(target, 1, requests=REQUESTS, context=CONTEXT)
        draft_runner = DraftDecodeCudaGraphRunner(draft_model, _config(), num_steps=k, show_progress=False)
        draft_runner.capture()
        draft = ModelDraft(draft_model, draft_fn=draft_runner.forward, read_between_proposes=True)
    stats = SpeculativeStats()
    got = speculative_generate(target, prompts, BUDGETS, draft, k, verify_fn=runner.forward, stats=stats)
    _assert_lossless(got, expected, logits)
    assert not runner.stats.fallbacks and sum(runner.stats.replays_by_size.values()) == stats.rounds
    if draft_name == "oracle":
        assert stats.rounds == max(-(-(b - 1) // (k + 1)) for b in BUDGETS)
    else:
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


@pytest.mark.parametrize("draft_name", ["oracle", "layer-skip"])
def test_a_round_synchronizes_the_host_with_the_device_once(target, draft_name):
    # torch's sync debug mode warns at every host-device synchronization (a read, a
    # pageable copy); each one is charged to the part of the loop it happened in, the
    # runners' forwards left out. A round's part from the draft's propose to the verify
    # (the draft's and the verify's uploads: pinned and asynchronous) synchronizes never,
    # its part from the verify's return to the next propose or the loop's end (the read
    # of the verify's tokens, acceptance, rollback, finished requests freed) exactly once.
    # The prefill's synchronizations, before the first propose, are not counted.
    import warnings

    k, budgets = 3, [9, 41, 17, 30]  # requests finish at different rounds
    prompts = make_dummy_prompts(4, staggered_lengths(4), target.config.vocab_size, seed=5)
    plain = greedy_generate(target, target.kv_cache, prompts, max(budgets))
    caught: list = []
    marks = []  # (event, synchronizations seen before it)

    def syncs():
        return sum("synchroniz" in str(w.message).lower() for w in caught)

    def unwatched(fn, before=None, after=None):
        def run(batch):
            if before:
                marks.append((before, syncs()))
            torch.cuda.set_sync_debug_mode(0)
            try:
                return fn(batch)
            finally:
                torch.cuda.set_sync_debug_mode(1)
                if after:
                    marks.append((after, syncs()))

        return run

    if draft_name == "oracle":
        inner = OracleDraft([p[:b] for p, b in zip(plain, budgets)])
    else:
        draft_model = layer_skip_draft(target, 1, requests=4, context=CONTEXT)
        inner = ModelDraft(
            draft_model,
            draft_fn=unwatched(lambda b: draft_steps(draft_model, b, k)),
            extend_fn=unwatched(eager_logits_fn(draft_model)),
            read_between_proposes=True,
        )

    class Marked:
        def prefill(self, prompts):
            inner.prefill(prompts)

        def propose(self, live, outputs, k):
            marks.append(("propose", syncs()))
            return inner.propose(live, outputs, k)

        def commit(self, live, proposals, accepted):
            inner.commit(live, proposals, accepted)

        def release(self, request):
            inner.release(request)

    verify = unwatched(eager_logits_fn(target), before="verify", after="verified")
    stats = SpeculativeStats()
    with warnings.catch_warnings(record=True) as recorded:
        warnings.simplefilter("always")
        caught = recorded
        torch.cuda.set_sync_debug_mode(1)
        try:
            got = speculative_generate(target, prompts, budgets, Marked(), k, verify_fn=verify, stats=stats)
            marks.append(("end", syncs()))
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert got == [p[:b] for p, b in zip(plain, budgets)]
    names = [name for name, _ in marks]
    assert names == ["propose", "verify", "verified"] * stats.rounds + ["end"] and stats.rounds >= 10, names
    counts = [n for _, n in marks]
    per_round = [
        (counts[3 * r + 1] - counts[3 * r], counts[3 * r + 3] - counts[3 * r + 2]) for r in range(stats.rounds)
    ]
    assert per_round == [(0, 1)] * stats.rounds, per_round
