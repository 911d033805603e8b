"""Speculative decoding on the CPU's emulated graphs in float32: the reference loop's greedy
tokens equal plain greedy decoding's exactly (ragged prompts, requests finishing at
different rounds, k = 1..5; oracle, target-as-draft and layer-skip drafts), rejected
tokens' KV slots are rolled back, and the draft runner's k-step graph gives eager's tokens.
GPU: test_speculative_gpu.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cuda_graph_runner.config import CudaGraphConfig
from cuda_graph_runner.reference.batches import (
    eager_logits_fn,
    greedy_generate,
    make_dummy_prompts,
    make_extend_batch,
    make_target_verify_batch,
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
from cuda_graph_runner_breakable.backend import BreakableCaptureError, BreakableCudaGraphBackend
from cuda_graph_runner_breakable.emulation import EmulatedGraphDeviceModule
from cuda_graph_runner_full.backend import FullCudaGraphBackend

REQUESTS, CONTEXT = 5, 48
BUDGETS = [3, 9, 14, 6, 11]  # tokens per request: they finish at different rounds
CONFIG = CudaGraphConfig.from_dict({"decode": {"bs": [5]}})  # one graph per runner: less CI time
BACKENDS = {"full": FullCudaGraphBackend, "breakable": BreakableCudaGraphBackend}


def _backend(name):
    return BACKENDS[name]("cpu", phase="decode", device_module=EmulatedGraphDeviceModule(), memory_pool="spec")


@pytest.fixture(scope="module")
def target():
    return reference_model("tiny", requests=REQUESTS, context=CONTEXT, device="cpu")


@pytest.fixture(scope="module")
def case(target):
    prompts = make_dummy_prompts(REQUESTS, staggered_lengths(REQUESTS), target.config.vocab_size, seed=7)
    full = greedy_generate(target, target.kv_cache, prompts, max(BUDGETS))
    return prompts, [f[:b] for f, b in zip(full, BUDGETS)]


@pytest.fixture(scope="module")
def verify_runners(target):
    runners = {}

    def get(k, greedy=False):
        if (k, greedy) not in runners:
            runner = (GreedyDecodeCudaGraphRunner if greedy else DecodeCudaGraphRunner)(
                target,
                CONFIG,
                backend=_backend("full"),
                mode="target_verify",
                num_tokens_per_req=k + 1,
                show_progress=False,
            )
            runner.capture()
            runners[k, greedy] = runner
        return runners[k, greedy]

    return get


def _assert_cache_empty(*models):
    for m in models:
        assert m.kv_cache.num_free_slots == m.kv_cache.num_slots - 1 and m.kv_cache.num_free_requests == REQUESTS


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_oracle_draft_is_lossless_and_every_known_token_is_accepted(target, case, verify_runners, k):
    prompts, expected = case
    runner = verify_runners(k)
    stats = SpeculativeStats()
    got = speculative_generate(
        target, prompts, BUDGETS, OracleDraft(expected), k, verify_fn=runner.forward, stats=stats
    )
    assert got == expected
    assert sum(runner.stats.replays_by_size.values()) == stats.rounds and not runner.stats.fallbacks
    # A round commits up to k + 1 tokens a request: the oracle's rounds are the fewest possible.
    assert stats.rounds == max(-(-(b - 1) // (k + 1)) for b in BUDGETS)
    assert stats.generated == sum(BUDGETS)
    _assert_cache_empty(target)


@pytest.mark.parametrize("k,backend", [(2, "breakable"), (4, "full")])
def test_target_as_its_own_draft_through_the_draft_graph_is_lossless(target, case, verify_runners, k, backend):
    prompts, expected = case
    draft_model = reference_model("tiny", requests=REQUESTS, context=CONTEXT, device="cpu")  # same seed: same weights
    draft_runner = DraftDecodeCudaGraphRunner(
        draft_model, CONFIG, num_steps=k, backend=_backend(backend), show_progress=False
    )
    extend_runner = DecodeCudaGraphRunner(draft_model, CONFIG, backend=_backend(backend), show_progress=False)
    draft_runner.capture()
    extend_runner.capture()
    stats = SpeculativeStats()
    draft = ModelDraft(
        draft_model, draft_fn=draft_runner.forward, extend_fn=extend_runner.forward, read_between_proposes=True
    )
    got = speculative_generate(target, prompts, BUDGETS, draft, k, verify_fn=verify_runners(k).forward, stats=stats)
    assert got == expected
    assert stats.accept_rate == 1.0  # the same model proposes the target's own tokens
    assert not draft_runner.stats.fallbacks and sum(draft_runner.stats.replays_by_size.values()) == stats.rounds
    # Every round but the last of each request accepted all k: the draft-extend step ran.
    assert sum(extend_runner.stats.replays_by_size.values()) > 0
    _assert_cache_empty(target, draft_model)


@pytest.mark.parametrize("k", [2, 4])
def test_a_layer_skip_draft_rejects_tokens_and_the_loop_stays_lossless(target, case, verify_runners, k):
    prompts, expected = case
    draft_model = layer_skip_draft(target, 1, requests=REQUESTS, context=CONTEXT)
    stats = SpeculativeStats()
    got = speculative_generate(
        target,
        prompts,
        BUDGETS,
        ModelDraft(draft_model, read_between_proposes=True),
        k,
        verify_fn=verify_runners(k).forward,
        stats=stats,
    )
    assert got == expected
    assert stats.accepted < stats.proposed  # rejections happened: the rollback ran
    _assert_cache_empty(target, draft_model)


@pytest.mark.parametrize("draft_name", ["oracle", "layer-skip"])
def test_a_verify_graph_that_records_the_argmax_is_lossless(target, case, verify_runners, draft_name):
    # The verify returns greedy tokens, not logits: host drafts (the oracle) are judged
    # on the tokens alone, device drafts (the layer-skip's eager steps) next to them.
    prompts, expected = case
    k = 3
    runner = verify_runners(k, greedy=True)
    if draft_name == "oracle":
        draft = OracleDraft(expected)
    else:
        draft = ModelDraft(layer_skip_draft(target, 1, requests=REQUESTS, context=CONTEXT), read_between_proposes=True)
    stats = SpeculativeStats()
    replays = sum(runner.stats.replays_by_size.values())  # the runner is shared by the module's tests
    got = speculative_generate(target, prompts, BUDGETS, draft, k, verify_fn=runner.forward, stats=stats)
    assert got == expected
    assert sum(runner.stats.replays_by_size.values()) - replays == stats.rounds and not runner.stats.fallbacks
    if draft_name == "oracle":
        assert stats.rounds == max(-(-(b - 1) // (k + 1)) for b in BUDGETS)
    else:
        assert stats.accepted < stats.proposed  # rejections happened: the rollback ran
    _assert_cache_empty(target)


def test_greedy_runner_replays_the_argmax_of_the_logits_graph_on_a_padded_batch(target, case, verify_runners):
    # 3 live requests replay the graph of 5: the tokens of the live rows, padding cut.
    prompts, _ = case
    k = 2
    greedy, logits = verify_runners(k, greedy=True), verify_runners(k)
    cache = target.kv_cache
    batch = make_extend_batch(cache, prompts[:3])
    rows = batch.req_pool_indices.tolist()
    step = make_target_verify_batch(cache, rows, [[1 + i, 2, 3] for i in range(3)])
    tokens = greedy.forward(step).clone()
    expected = logits.forward(step).argmax(dim=-1)
    assert tokens.dtype == torch.int64 and tokens.shape == (3 * (k + 1),) and torch.equal(tokens, expected)
    assert greedy.stats.replays_by_size.get(3) and not greedy.stats.fallbacks  # replayed, not eager
    assert [(key.size, key.variant) for key in greedy.captured_keys] == [(5, f"greedy:target_verify:{k + 1}")]
    for r in rows:
        cache.free_request(r)


def test_eager_loop_matches_plain_greedy_with_one_token_budgets(target, case):
    prompts, expected = case
    budgets = [1, 2, 1, 4, 3]
    got = speculative_generate(target, prompts, budgets, OracleDraft(expected), 2)
    assert got == [e[:b] for e, b in zip(expected, budgets)]
    _assert_cache_empty(target)


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_draft_runner_replay_equals_eager_steps_on_a_ragged_padded_batch(target, backend):
    k = 3
    draft_model = layer_skip_draft(target, 1, requests=REQUESTS, context=CONTEXT)
    runner = DraftDecodeCudaGraphRunner(
        draft_model, CONFIG, num_steps=k, backend=_backend(backend), show_progress=False
    )
    runner.capture()
    cache = draft_model.kv_cache
    prompts = make_dummy_prompts(3, [4, 9, 6], target.config.vocab_size, seed=3)  # 3 requests pad to the size-5 graph
    prefill = make_extend_batch(cache, prompts)
    rows = prefill.req_pool_indices.tolist()
    with torch.no_grad():
        eager_logits_fn(draft_model)(prefill)
        batch = make_draft_batch(cache, rows, [p[-1] for p in prompts], k)
        expected = draft_steps(draft_model, batch, k).clone()
        got = runner.forward(batch).clone()
    assert got.shape == (3, k) and got.dtype == torch.int64
    assert torch.equal(got, expected)
    assert runner.stats.replays_by_size == {3: 1}
    assert [key.variant for key in runner.backend.captured_keys] == ["draft:3"]
    for r in rows:
        cache.free_request(r)


def test_bad_arguments_are_refused_with_the_value_named(target):
    draft_model = reference_model("tiny", requests=2, context=16, device="cpu")
    with pytest.raises(ValueError, match="num_steps=0"):
        DraftDecodeCudaGraphRunner(draft_model, CONFIG, num_steps=0, backend=_backend("full"), show_progress=False)
    with pytest.raises(ValueError, match="mode="):
        DraftDecodeCudaGraphRunner(draft_model, CONFIG, num_steps=2, mode="decode", backend=_backend("full"))
    with pytest.raises(ValueError, match="k=0"):
        speculative_generate(target, [[1, 2]], 3, OracleDraft([[1, 2, 3]]), 0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(target, [[1, 2]], [3, 4], OracleDraft([[1, 2, 3]]), 2)
    runner = DraftDecodeCudaGraphRunner(draft_model, CONFIG, num_steps=3, backend=_backend("full"), show_progress=False)
    runner.capture()
    prefill = make_extend_batch(draft_model.kv_cache, [[1, 2, 3], [4, 5]])
    plain = make_draft_batch(draft_model.kv_cache, prefill.req_pool_indices.tolist(), [3, 5], 1)  # 1 slot, not 3
    with pytest.raises(ValueError, match="out_cache_loc has 2 slots for 2 requests; num_steps=3 takes 6"):
        runner.forward(plain)
    planned = reference_model("tiny", requests=2, context=16, device="cpu", attention="planned_standin")
    with pytest.raises(ValueError, match="init_forward_metadata_replay.*num_steps=2"):
        DraftDecodeCudaGraphRunner(planned, CONFIG, num_steps=2, backend=_backend("full"), show_progress=False)
    with pytest.raises(ValueError, match="num_layers=3"):
        layer_skip_draft(target, 3, requests=2, context=16)


def test_the_engine_side_example_is_lossless_with_eager_runners():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "speculative_decoding.py"
    spec = importlib.util.spec_from_file_location("speculative_decoding", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    same, stats = module.run("cpu", "disabled", k=2, requests=3, draft_layers=1)
    assert same and stats.rounds > 0 and stats.generated == sum(4 + 5 * i for i in range(3))


def test_a_breakable_draft_graph_that_would_break_after_step_0_is_refused_at_capture(target):
    # Breaking at every marked op: step 1's attention would replay eagerly with step 0's batch.
    draft_model = layer_skip_draft(target, 1, requests=REQUESTS, context=CONTEXT)
    backend = BreakableCudaGraphBackend(
        "cpu",
        phase="decode",
        device_module=EmulatedGraphDeviceModule(),
        memory_pool="spec",
        inline_capture_safe_ops=False,
    )
    runner = DraftDecodeCudaGraphRunner(draft_model, CONFIG, num_steps=2, backend=backend, show_progress=False)
    with pytest.raises(BreakableCaptureError, match="reference_llama_attention.*would run eagerly.*step 0's batch"):
        runner.capture()
    # One step has nothing after step 0: it captures and replays.
    one = DraftDecodeCudaGraphRunner(
        draft_model, CONFIG, num_steps=1, backend=_backend("breakable"), show_progress=False
    )
    one.capture()
    assert one.backend.captured_keys


def test_draft_runner_on_the_compiled_backend_equals_eager_steps(target, monkeypatch):
    # The CPU's compiling backend (its forward traced by Dynamo; aot_eager: no code generation).
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_COMPILED_COMPILER", "aot_eager")
    k = 3
    draft_model = layer_skip_draft(target, 1, requests=REQUESTS, context=CONTEXT)
    config = CudaGraphConfig.from_dict({"decode": {"backend": "compiled", "bs": [5]}})
    runner = DraftDecodeCudaGraphRunner(draft_model, config, num_steps=k, device="cpu", show_progress=False)
    runner.capture()
    cache = draft_model.kv_cache
    prompts = make_dummy_prompts(3, [4, 9, 6], target.config.vocab_size, seed=3)
    prefill = make_extend_batch(cache, prompts)
    with torch.no_grad():
        eager_logits_fn(draft_model)(prefill)
        batch = make_draft_batch(cache, prefill.req_pool_indices.tolist(), [p[-1] for p in prompts], k)
        expected = draft_steps(draft_model, batch, k).clone()
        got = runner.forward(batch).clone()
    assert torch.equal(got, expected) and runner.stats.replays_by_size == {3: 1} and not runner.stats.fallbacks
    for r in prefill.req_pool_indices.tolist():
        cache.free_request(r)


def test_step_batch_equals_the_per_request_builder_and_refuses_overflow_whole():
    from cuda_graph_runner.reference.batches import make_target_verify_batch
    from cuda_graph_runner.reference.kv_cache import CacheFullError, PagedKVCache
    from cuda_graph_runner.reference.speculative import step_batch

    caches = [PagedKVCache(1, 1, 2, num_slots=40, max_reqs=4, max_context_len=12) for _ in range(2)]
    for cache in caches:
        rows = [cache.alloc_request() for _ in range(3)]
        for r, n in zip(rows, (2, 5, 3)):
            cache.assign_slots(r, cache.alloc_slots(n))
    tokens = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    fast, slow = step_batch(caches[0], rows, tokens), make_target_verify_batch(caches[1], rows, tokens)
    for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens"):
        a, b = getattr(fast, name), getattr(slow, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert fast.forward_mode is slow.forward_mode and fast.seq_lens_cpu == slow.seq_lens_cpu
    assert torch.equal(caches[0].req_to_token, caches[1].req_to_token)
    free = caches[0].num_free_slots
    with pytest.raises(CacheFullError, match="row .* would hold 13 tokens"):
        step_batch(caches[0], rows, [[1] * 5] * 3)  # row 2 holds 8: 13 > 12
    assert caches[0].num_free_slots == free and [caches[0].request_len(r) for r in rows] == [5, 8, 6]


def test_a_draft_batch_passes_the_data_parallel_step_and_replays(target):
    # Its out_cache_loc holds k slots per request: the DP step's live-batch check takes that width.
    from cuda_graph_runner.runner.data_parallel import dp_forward

    class OwnValuesDP:  # the step agreement in one process: every rank's values are this rank's
        def agree_batch(self, size, ready, variant, *, variants=("",), failed=None):
            assert failed is None, failed
            return size, ready, variant

    k = 2
    draft_model = layer_skip_draft(target, 1, requests=REQUESTS, context=CONTEXT)
    runner = DraftDecodeCudaGraphRunner(draft_model, CONFIG, num_steps=k, backend=_backend("full"), show_progress=False)
    runner.capture()
    cache = draft_model.kv_cache
    prompts = make_dummy_prompts(2, [5, 7], target.config.vocab_size, seed=5)
    prefill = make_extend_batch(cache, prompts)
    rows = prefill.req_pool_indices.tolist()
    with torch.no_grad():
        eager_logits_fn(draft_model)(prefill)
        batch = make_draft_batch(cache, rows, [p[-1] for p in prompts], k)
        expected = draft_steps(draft_model, batch, k).clone()
        got = dp_forward(runner, OwnValuesDP(), batch).clone()
    assert torch.equal(got, expected) and runner.stats.replays_by_size == {2: 1}
    for r in rows:
        cache.free_request(r)


def test_device_drafts_are_judged_as_verified_when_the_verify_reuses_their_memory(target, case):
    # A draft runner's zero-copy output lives in graph memory that the verify replay may
    # write: here the verify forward overwrites the draft's tensor before returning. The
    # round must judge the drafts it verified, not what that memory holds afterwards.
    prompts, expected = case
    k = 2
    held = {}

    class DeviceOracle(OracleDraft):
        def propose(self, live, outputs, k):
            held["tokens"] = torch.tensor(super().propose(live, outputs, k), dtype=torch.int64)
            return held["tokens"]

    eager = eager_logits_fn(target)

    def verify_reusing_the_draft_memory(batch):
        logits = eager(batch)
        held["tokens"].fill_(-1)
        return logits

    stats = SpeculativeStats()
    got = speculative_generate(
        target, prompts, BUDGETS, DeviceOracle(expected), k, verify_fn=verify_reusing_the_draft_memory, stats=stats
    )
    assert got == expected
    assert stats.rounds == max(-(-(b - 1) // (k + 1)) for b in BUDGETS)  # every known draft accepted
    _assert_cache_empty(target)


class _RoundSpy(TorchDispatchMode):
    """Records, between the verify forwards of a loop, the device ops the loop itself runs
    (runner forwards excluded) and its device-to-host reads (``tolist``/``item``/...)."""

    READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy")

    def __init__(self, monkeypatch):
        super().__init__()
        self.rounds = [[]]  # rounds[i]: events after verify i (0: before the first)
        self.paused = False
        for name in self.READS:
            original = getattr(torch.Tensor, name)

            def spy(t, *args, _name=name, _original=original, **kwargs):
                if not self.paused:
                    self.rounds[-1].append(f"read:{_name}")
                return _original(t, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, spy)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.rounds[-1].append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))

    def runner(self, fn, *, verify=False):
        def run(batch):
            self.paused = True
            try:
                return fn(batch)
            finally:
                self.paused = False
                if verify:
                    self.rounds.append([])

        return run


def _spied_rounds(target, prompts, budget, draft, k, monkeypatch, greedy=False):
    spy = _RoundSpy(monkeypatch)
    eager = eager_logits_fn(target)
    # greedy: the verify returns tokens (its argmax is the runner's, as a greedy graph's)
    verify = spy.runner((lambda b: eager(b).argmax(dim=-1)) if greedy else eager, verify=True)
    with spy:
        speculative_generate(target, prompts, budget, draft(spy), k, verify_fn=verify)
    monkeypatch.undo()
    return spy.rounds[1:-1]  # full rounds: from one verify's end to the next verify


@pytest.mark.parametrize("draft_name", ["oracle", "layer-skip"])
def test_a_round_reads_the_device_once_and_runs_no_per_request_device_op(target, case, draft_name, monkeypatch):
    prompts, _ = case
    k, budget = 3, 13
    seen = {}
    for n in (1, 4):
        if draft_name == "oracle":
            # The oracle proposes the target's own tokens: each is accepted, no request ends early.
            expected = greedy_generate(target, target.kv_cache, prompts[:n], budget)

            def draft(spy, expected=expected):
                return OracleDraft(expected)
        else:
            draft_model = layer_skip_draft(target, 1, requests=REQUESTS, context=CONTEXT)

            def draft(spy, draft_model=draft_model):
                return ModelDraft(
                    draft_model,
                    draft_fn=spy.runner(lambda b: draft_steps(draft_model, b, k)),
                    extend_fn=spy.runner(eager_logits_fn(draft_model)),
                    read_between_proposes=True,
                )

        rounds = _spied_rounds(target, prompts[:n], budget, draft, k, monkeypatch)
        assert len(rounds) >= 2
        for events in rounds:
            # One device read a round (the verify's tokens and the drafts it saw), after the
            # verify and before anything else reads: no .item()/.tolist() per request or token.
            assert [e for e in events if e.startswith("read:")] == ["read:tolist"], events
        seen[n] = rounds
        _assert_cache_empty(target)
    if draft_name == "oracle":
        # Every request is live in every round: a per-request device op (a table clear, a
        # per-request copy) would make a round of 4 requests run more ops than one of 1.
        assert {len(r) for r in seen[1]} == {len(r) for r in seen[4]} and len({len(r) for r in seen[1]}) == 1


@pytest.mark.parametrize("greedy", [False, True], ids=["logits-verify", "greedy-verify"])
@pytest.mark.parametrize("draft_name", ["oracle", "target-as-draft"])
def test_a_steady_round_allocates_no_tensor_and_makes_no_view(target, case, draft_name, greedy, monkeypatch):
    # Every request live in every round and every draft accepted: after the first rounds
    # (the buffers' views are made once per step shape), a round's own device ops are its
    # table writes, the drafts' copy and the argmax, and its one read; no tensor built
    # from host lists, no split or slice of a fresh upload, no cast. The exact list is a
    # count of the loop's own torch ops a round: one more is host time on every round.
    # A verify that returns tokens leaves no argmax: host drafts are judged on its
    # tokens as read, device drafts on its tokens copied next to them.
    prompts, _ = case
    k, budget = 3, 17
    expected = greedy_generate(target, target.kv_cache, prompts, budget)
    if draft_name == "oracle":
        steady = ["read:tolist", "aten.index_copy_"] if greedy else ["aten.argmax", "read:tolist", "aten.index_copy_"]

        def draft(spy):
            return OracleDraft(expected)
    else:
        draft_model = reference_model("tiny", requests=REQUESTS, context=CONTEXT, device="cpu")  # same weights
        # The draft-extend batch's and the k-step batch's table writes, then the drafts
        # copied into the verify batch after its table write.
        steady = [
            "aten.copy_" if greedy else "aten.argmax",
            "read:tolist",
            "aten.index_copy_",
            "aten.index_copy_",
            "aten.index_copy_",
            "aten.copy_",
        ]

        def draft(spy):
            return ModelDraft(
                draft_model,
                draft_fn=spy.runner(lambda b: draft_steps(draft_model, b, k)),
                extend_fn=spy.runner(eager_logits_fn(draft_model)),
                read_between_proposes=True,
            )

    rounds = _spied_rounds(target, prompts, budget, draft, k, monkeypatch, greedy=greedy)
    assert len(rounds) == -(-(budget - 1) // (k + 1)) - 1 >= 3
    for events in rounds[1:]:
        assert events == steady, events
    _assert_cache_empty(target)


def test_step_buffers_are_reused_across_shapes_and_give_step_batch_fields():
    from cuda_graph_runner.reference.batches import make_target_verify_batch
    from cuda_graph_runner.reference.kv_cache import PagedKVCache
    from cuda_graph_runner.reference.speculative import StepBuffers, step_batch

    caches = [PagedKVCache(1, 1, 2, num_slots=200, max_reqs=8, max_context_len=40) for _ in range(2)]
    rows = []
    for cache in caches:
        rows = [cache.alloc_request() for _ in range(6)]
        for r, n in zip(rows, (2, 5, 3, 1, 4, 6)):
            cache.assign_slots(r, cache.alloc_slots(n))
    buffers = StepBuffers("cpu")
    memory = None
    # Growing then shrinking shapes: the memory grows once for the largest and is kept.
    for bs, w in ((2, 3), (6, 5), (3, 1), (6, 5), (1, 4)):
        tokens = [[10 * i + j for j in range(w)] for i in range(bs)]
        fast = step_batch(caches[0], rows[:bs], tokens, buffers=buffers)
        slow = make_target_verify_batch(caches[1], rows[:bs], tokens) if w > 1 else None
        if slow is None:
            slow = step_batch(caches[1], rows[:bs], tokens)
        for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens"):
            a, b = getattr(fast, name), getattr(slow, name)
            assert a.dtype == b.dtype and torch.equal(a, b), (bs, w, name)
        assert fast.seq_lens_cpu == slow.seq_lens_cpu and torch.equal(caches[0].req_to_token, caches[1].req_to_token)
        if (bs, w) == (6, 5):
            memory = memory or fast.input_ids.untyped_storage().data_ptr()
        assert memory is None or fast.input_ids.untyped_storage().data_ptr() == memory
    with pytest.raises(ValueError, match=r"same non-zero width, got \[1, 2\]"):
        step_batch(caches[0], rows[:2], [[1], [1, 2]], buffers=buffers)
    # A refused token is named, and the step reserves nothing: the cache is as it was.
    lens = [caches[0].request_len(r) for r in rows[:2]]
    table = caches[0].req_to_token.clone()
    for bad in (1.5, -1, True):
        with pytest.raises(ValueError, match=rf"token {bad!r} is not accepted; accepted: token ids"):
            step_batch(caches[0], rows[:2], [[1, bad], [1, 2]], buffers=buffers)
        assert [caches[0].request_len(r) for r in rows[:2]] == lens
        assert torch.equal(caches[0].req_to_token, table)


def test_a_model_draft_fences_its_step_buffers_unless_told_the_caller_reads(target, monkeypatch):
    import cuda_graph_runner.reference.speculative as speculative

    made = []

    class Recording(speculative.StepBuffers):
        def __init__(self, device, *, read_between_steps=False):
            made.append(read_between_steps)
            super().__init__(device, read_between_steps=read_between_steps)

    monkeypatch.setattr(speculative, "StepBuffers", Recording)
    draft_model = layer_skip_draft(target, 1, requests=REQUESTS, context=CONTEXT)
    ModelDraft(draft_model)
    assert made == [False, False]  # default: each batch's upload records an event (on CUDA)
    ModelDraft(draft_model, read_between_proposes=True)
    assert made[2:] == [True, True]
    with pytest.raises(TypeError, match="read_between_proposes=1"):
        ModelDraft(draft_model, read_between_proposes=1)
