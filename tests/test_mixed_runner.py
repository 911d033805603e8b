"""The mixed runner on the CPU: prefill chunks and decodes (one-token extends) in one
graph per requests x tokens key, on the breakable plugin's emulated graphs (a replay
re-runs the recorded aten ops on the recorded tensors).

Checked: the key choice (fewest padded tokens, then fewest request slots), the captured
grid, both axes' padding (device buffers, host lists, one attention plan per key), the
config's sizes per axis and their errors, a batch no key covers run eagerly with its
reason, the run statistics' waste on both axes, and fp32 replay == eager bit for bit in
a continuous-batching schedule with chunked prefill for ``full`` (the ``planned_standin``
attention, re-planned by the replay hook) and ``breakable`` (the eager attention).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import pytest
import torch
from cpu_gemm import assert_replay_matches, replay_rows_exact

from cuda_graph_runner.backend.base import ShapeKey
from cuda_graph_runner.backend.forward_batch import _stored
from cuda_graph_runner.config import CudaGraphConfig, CudaGraphConfigError
from cuda_graph_runner.reference.batches import eager_logits_fn, make_dummy_prompts, make_extend_batch
from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM
from cuda_graph_runner.runner import MixedCudaGraphRunner
from cuda_graph_runner.runner.base import key_label
from cuda_graph_runner.runner.mixed import choose_key
from cuda_graph_runner.runner.stats import REASON_NO_KEY, format_summary

emulation = pytest.importorskip("cuda_graph_runner_breakable.emulation")
full = pytest.importorskip("cuda_graph_runner_full.backend")
breakable = pytest.importorskip("cuda_graph_runner_breakable.backend")

CONTEXT = 64
TOKENS = [8, 16, 32]
REQUESTS = [1, 4, 8]


def make_model(attention: str = "planned_standin", requests: int = 16) -> ReferenceLlamaForCausalLM:
    model = ReferenceLlamaForCausalLM.from_preset("tiny", attention=attention)
    model.create_kv_cache(num_slots=requests * CONTEXT + 1, max_reqs=requests + 1, max_context_len=CONTEXT)
    return model


def make_backend(name: str) -> Any:
    dm = emulation.EmulatedGraphDeviceModule()
    cls = full.FullCudaGraphBackend if name == "full" else breakable.BreakableCudaGraphBackend
    return cls("cpu", phase="prefill", device_module=dm, memory_pool=dm.pool_handle)


def make_runner(model: Any, backend: str = "full", tokens=TOKENS, requests=REQUESTS, **kwargs: Any):
    config = {"prefill": {"mixed_tokens": list(tokens), "mixed_requests": list(requests)}}
    return MixedCudaGraphRunner(
        model, config, device="cpu", backend=make_backend(backend), show_progress=False, **kwargs
    )


# -- key choice --------------------------------------------------------------------------


def grid(tokens: Sequence[int], requests: Sequence[int]) -> List[ShapeKey]:
    return [ShapeKey(t, "mixed", requests=r) for t in tokens for r in requests if r <= t]


def test_key_choice_fewest_padded_tokens_then_fewest_request_slots():
    keys = grid([8, 16, 32], [1, 4, 8])
    pick = {
        (r, t): (k.requests, k.size)
        for r, t in [(1, 5), (3, 5), (5, 8), (2, 9), (8, 30), (1, 32)]
        for k in [choose_key(keys, r, t)]
    }
    assert pick == {(1, 5): (1, 8), (3, 5): (4, 8), (5, 8): (8, 8), (2, 9): (4, 16), (8, 30): (8, 32), (1, 32): (1, 32)}
    # Fewer padded tokens win over fewer slots: 5 requests of 9 tokens take 8 x 16, not
    # a larger token count with fewer slots.
    sparse = [ShapeKey(16, "mixed", requests=8), ShapeKey(32, "mixed", requests=5)]
    assert choose_key(sparse, 5, 9) == ShapeKey(16, "mixed", requests=8)
    # A request count only the larger token count holds moves the batch there.
    uneven = [ShapeKey(16, "mixed", requests=4), ShapeKey(32, "mixed", requests=16)]
    assert choose_key(uneven, 9, 10) == ShapeKey(32, "mixed", requests=16)
    assert choose_key(keys, 9, 10) is None and choose_key(keys, 1, 33) is None
    assert choose_key([ShapeKey(16, "decode")], 1, 4) is None  # one-dimensional keys are not candidates


def test_shape_key_second_axis_is_validated_and_labelled():
    assert key_label(ShapeKey(256, "mixed", requests=32)) == "32x256|mixed"
    assert key_label(ShapeKey(256, "extend")) == "256|extend" and ShapeKey(4).requests is None
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="ShapeKey.requests must be None or a positive int"):
            ShapeKey(8, "mixed", requests=bad)  # type: ignore[arg-type]


# -- config ------------------------------------------------------------------------------


def test_sizes_per_axis_default_and_normalise():
    config = CudaGraphConfig.from_dict({"prefill": {"mixed_tokens": [256, 64, 64], "mixed_requests": [8, 1]}})
    assert config.prefill.mixed_sizes() == ([64, 256], [1, 8])
    assert CudaGraphConfig().prefill.mixed_sizes() == ([64, 128, 256, 512], [1, 2, 4, 8, 16, 32])


@pytest.mark.parametrize("key", ["mixed_tokens", "mixed_requests"])
@pytest.mark.parametrize("value", [[], [0], [4, -2], [True], "64", [70000]])
def test_bad_sizes_per_axis_are_refused_naming_key_and_value(key, value):
    with pytest.raises(CudaGraphConfigError) as info:
        CudaGraphConfig.from_dict({"prefill": {key: value}})
    assert (info.value.phase, info.value.key, info.value.value) == ("prefill", key, value)
    assert "65536" in str(info.value)  # what is accepted


def test_request_counts_above_every_token_count_and_the_decode_phase_are_refused():
    with pytest.raises(CudaGraphConfigError, match="largest mixed token count 16") as info:
        CudaGraphConfig.from_dict({"prefill": {"mixed_tokens": [8, 16], "mixed_requests": [32, 64]}})
    assert (info.value.key, info.value.value) == ("mixed_requests", [32, 64])
    with pytest.raises(CudaGraphConfigError, match="read by the prefill phase only") as info:
        CudaGraphConfig.from_dict({"decode": {"mixed_tokens": [64]}})
    assert (info.value.phase, info.value.key) == ("decode", "mixed_tokens")


def test_full_with_an_attention_without_replay_hook_is_refused_naming_it():
    with pytest.raises(CudaGraphConfigError, match="attention 'torch'") as info:
        make_runner(make_model(attention="torch"), "full")
    assert (info.value.key, info.value.value) == ("backend", "FullCudaGraphBackend")
    assert "breakable" in str(info.value)
    make_runner(make_model(attention="torch"), "breakable")  # breakable runs attention eagerly


def test_token_counts_no_request_count_can_hold_are_refused():
    with pytest.raises(CudaGraphConfigError, match="gives no key that can be captured") as info:
        make_runner(make_model(), tokens=[128], requests=[1], max_request_tokens=64)
    assert info.value.key == "mixed_requests"


# -- capture and padding -----------------------------------------------------------------


def test_captured_grid_and_describe_name_both_axes():
    model = make_model()
    runner = make_runner(model, max_request_tokens=8)  # 32 tokens need >= 4 requests of 8
    with torch.no_grad():
        report = runner.capture()
    shapes = [(k.requests, k.size) for k in runner.captured_keys]
    assert shapes == [(8, 32), (4, 32), (8, 16), (4, 16), (8, 8), (4, 8), (1, 8)]
    assert report.sizes == [32, 16, 8]
    graphs = runner.describe()["graphs"]
    assert [g["key"] for g in graphs][:2] == ["8x32|mixed", "4x32|mixed"] and graphs[0]["requests"] == 8
    # One attention plan per key: the graph variant names the request slots.
    assert sorted(k[2:] for k in model.attn_backend.states) == sorted((t, f"mixed_r{r}") for r, t in shapes)


def test_replay_pads_both_axes_with_sentinels():
    model = make_model()
    runner = make_runner(model, tokens=[8, 16], requests=[4])
    cache = model.kv_cache
    with torch.no_grad():
        runner.capture()
        prompts = make_dummy_prompts(2, [6, 6], model.config.vocab_size, seed=1)
        first = make_extend_batch(cache, prompts)
        runner.forward(first)
        rows = first.req_pool_indices.tolist()
        # A 3-token chunk of a new prompt beside the two decodes: 3 requests, 5 tokens -> 4 x 8.
        step = make_extend_batch(cache, [[1, 2, 3], [7], [9]], rows=[cache.alloc_request(), *rows])
        key, static = runner.replay_prepare(step)
    assert (key.requests, key.size) == (4, 8)
    assert static.req_pool_indices.tolist() == [*step.req_pool_indices.tolist(), 0]
    assert static.extend_seq_lens.tolist() == [3, 1, 1, 0] and static.extend_prefix_lens.tolist() == [0, 6, 6, 0]
    assert static.seq_lens.tolist() == [3, 7, 7, 0] and _stored(static, "seq_lens_cpu") == [3, 7, 7, 0]
    assert _stored(static, "extend_prefix_lens_cpu") == [0, 6, 6, 0]
    assert static.input_ids.tolist()[5:] == [0, 0, 0] and static.out_cache_loc.tolist()[5:] == [0, 0, 0]
    assert static.graph_variant == "mixed_r4"
    plan = model.attn_backend.plan_log[-1]
    assert plan.kind == "replay" and plan.extend_seq_lens == [3, 1, 1, 0]


def test_breakable_replays_on_the_live_request_axis():
    model = make_model(attention="torch")
    runner = make_runner(model, "breakable", tokens=[8], requests=[1, 4])
    with torch.no_grad():
        runner.capture()
        step = make_extend_batch(model.kv_cache, [[1, 2, 3], [7], [9]])
        key, static = runner.replay_prepare(step)
    assert (key.requests, key.size) == (4, 8) and static.input_ids.shape == (8,)
    assert static.req_pool_indices is step.req_pool_indices and static.extend_seq_lens is step.extend_seq_lens
    assert _stored(static, "extend_seq_lens_cpu") == [3, 1, 1]


# -- replay == eager (fp32, bit for bit) in a continuous-batching schedule ---------------


def run_schedule(runner: Any, model: Any, chunk: int = 12, steps: int = 12) -> Dict[str, int]:
    """Prompts arrive; each step runs one prefill chunk of the oldest unfinished prompt
    beside one decode per prompt already prefilled; a request leaves after 4 decodes.
    Every step must replay equal to its eager forward: bit for bit where this CPU's GEMMs
    give the live rows the same bits among the padded ones (:mod:`cpu_gemm`), else within
    float32 rounding."""
    cache = model.kv_cache
    eager = eager_logits_fn(model)
    arrivals = {0: [20, 7], 2: [30], 4: [5, 5, 9], 7: [26]}
    waiting: List[List[Any]] = []  # [row, tokens left to prefill]
    decoding: Dict[int, int] = {}  # row -> decodes done
    counts = {"replayed": 0, "eager": 0, "mixed": 0, "exact": 0}
    seed = 0
    for step in range(steps):
        for n in arrivals.get(step, []):
            waiting.append([cache.alloc_request(), make_dummy_prompts(1, [n], model.config.vocab_size, seed=seed)[0]])
            seed += 1
        rows: List[int] = []
        tokens: List[List[int]] = []
        if waiting:
            row, left = waiting[0]
            rows.append(row)
            tokens.append(left[:chunk])
            waiting[0][1] = left[chunk:]
        for row in decoding:
            rows.append(row)
            tokens.append([(row * 7 + decoding[row]) % model.config.vocab_size])
        if not rows:
            continue
        batch = make_extend_batch(cache, tokens, rows=rows)
        if waiting and not waiting[0][1]:
            decoding[waiting.pop(0)[0]] = 0
        replays = runner.can_run(batch)
        got = runner.forward(batch).clone()
        expected = eager(batch)
        if replays:  # padded to the fewest tokens that hold the step (the key's token count)
            exact = replay_rows_exact(model, batch.num_tokens, runner.phase_config.mixed_sizes()[0])
            counts["exact"] += exact
        else:  # an eager step is the eager forward itself
            exact = True
        assert_replay_matches(got, expected, exact, f"step {step}: lengths {batch.extend_seq_lens_cpu}")
        counts["replayed" if replays else "eager"] += 1
        counts["mixed"] += replays and len(rows) > 1 and max(len(t) for t in tokens) > 1
        for row in list(decoding):
            if len(tokens[rows.index(row)]) == 1:
                decoding[row] += 1
                if decoding[row] == 4:
                    del decoding[row]
                    cache.free_request(row)
    return counts


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_continuous_batching_with_chunked_prefill_replays_equal_eager_exactly(backend):
    model = make_model(attention="planned_standin" if backend == "full" else "torch")
    runner = make_runner(model, backend, tokens=[8, 16], requests=[1, 4])
    with torch.no_grad():
        runner.capture()
        counts = run_schedule(runner, model)
    stats = runner.run_stats()
    # Steps of more than 4 requests (a chunk beside 4+ decodes) have no key: eager, counted.
    # Every step matched eager; the replays of a captured token count (8 tokens: steps 1, 2
    # and 5) match bit for bit on any CPU, more where this CPU's GEMMs allow.
    assert counts["mixed"] >= 4 and counts["eager"] >= 1 and counts["replayed"] >= 8 and counts["exact"] >= 3
    assert stats["replays"] == counts["replayed"] and stats["eager_fallbacks"] == {REASON_NO_KEY: counts["eager"]}
    shapes = stats["shape_padding"]
    assert sum(s["replays"] for s in shapes) == counts["replayed"]
    assert {tuple(s["key"]) for s in shapes} <= {(1, 8), (4, 8), (1, 16), (4, 16)}
    assert stats["padded_rows"] == sum(s["padded_tokens"] for s in shapes) > 0
    if backend == "full":  # the request axis padded with sentinels
        assert sum(s["padded_requests"] for s in shapes) > 0 and stats["shape_waste"]["requests"] > 0
    else:  # breakable runs attention eagerly on the live request axis: nothing padded
        assert sum(s["padded_requests"] for s in shapes) == 0 == stats["shape_waste"]["requests"]
    assert "request-slot waste" in format_summary("mixed", stats)


def test_a_batch_no_key_covers_runs_eagerly_with_its_reason():
    model = make_model()
    runner = make_runner(model, tokens=[8, 16], requests=[1, 2])
    eager = eager_logits_fn(model)
    with torch.no_grad():
        runner.capture()
        batch = make_extend_batch(model.kv_cache, [[1], [2], [3]])  # 3 requests: no key has 3 slots
        assert not runner.can_run(batch)
        got = runner.forward(batch)
        assert torch.equal(got, eager(batch))
        with pytest.raises(ValueError, match="no captured mixed key covers 3 requests x 3 tokens"):
            runner.replay_prepare(batch)
        too_long = make_extend_batch(model.kv_cache, [list(range(1, 18))])
        runner.forward(too_long)
    assert runner.run_stats()["eager_fallbacks"] == {REASON_NO_KEY: 1, "too large": 1}


def test_capture_plan_lists_both_axes():
    from cuda_graph_runner.backend.capture_plan import build_capture_plan

    runner = make_runner(make_model(), tokens=[8, 16], requests=[2, 8])
    plan = build_capture_plan(runner)
    assert plan.shapes == [(8, 16), (2, 16), (8, 8), (2, 8)]
    batch = plan.static_batch(ShapeKey(8, "mixed", requests=2))
    assert batch.req_pool_indices.shape == (2,) and batch.input_ids.shape == (8,)
    assert _stored(batch, "extend_seq_lens_cpu") == [8, 0] and batch.graph_variant == "mixed_r2"


def test_a_replay_range_names_both_axes():
    from cuda_graph_runner.backend.profiling import replay_range_name

    name = replay_range_name("prefill", "full", ShapeKey(288, "mixed", requests=32))
    assert name.endswith("prefill/full/bs=288 mixed requests=32")
    assert replay_range_name("decode", "full", ShapeKey(8, "decode")).endswith("decode/full/bs=8 decode")


def test_tp_ranks_on_other_request_slots_would_disagree():
    # The TP step agreement compares a digest of the key: both axes must count.
    from cuda_graph_runner.runner.distributed import TPGroup

    group = TPGroup(rank=0, size=1, device=torch.device("cpu"))
    digests = {group._digest(ShapeKey(16, "mixed", requests=r)) for r in (None, 4, 8)}
    assert len(digests) == 3


def test_eager_first_serves_eagerly_until_the_covering_size_is_captured():
    model = make_model()
    config = {"prefill": {"mixed_tokens": [8, 16], "mixed_requests": [4], "capture": "eager_first"}}
    runner = MixedCudaGraphRunner(model, config, device="cpu", backend=make_backend("full"), show_progress=False)
    eager = eager_logits_fn(model)
    with torch.no_grad():
        runner.capture()
        batch = make_extend_batch(model.kv_cache, [[1, 2, 3, 4, 5, 6, 7, 8, 9], [3]])
        assert torch.equal(runner.forward(batch), eager(batch))
        assert runner.run_stats()["eager_fallbacks"] == {"not captured yet": 1}
        runner.capture_step(None)
        assert runner.can_run(batch)
        exact = replay_rows_exact(model, batch.num_tokens, [8, 16])
        assert_replay_matches(runner.forward(batch).clone(), eager(batch), exact, "the covering size's replay")
