"""Backend ``breakable`` with the reference model on a CUDA device: graph output equals eager.

* prefill: token counts on and off the buckets, the maximum, batches mixing request
  lengths and cached prefixes (chunked prefill next to fresh requests); the KV cache the
  graph writes equals eager's; the 2x rule and the maximum fall back to eager;
* prefill: one bucket replayed with ever-changing request layouts (stale metadata);
* decode: padded batch sizes, several steps;
* bfloat16 prefill within bf16 tolerance.

Run on the device machine: ``python -m pytest plugins/breakable/tests/test_breakable_model_gpu.py``.
"""

from __future__ import annotations

from typing import Any, List

import pytest
import torch

from cuda_graph_runner.testing.reference_setup import next_decode_batch, reference_model
from cuda_graph_runner.testing.workload import (
    DecodeCudaGraphRunner,
    GreedySession,
    PrefillCudaGraphRunner,
    ReferenceLlamaForCausalLM,
    eager_logits_fn,
    make_dummy_prompts,
    make_extend_batch,
)

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
MAX_TOKENS = 256
CONTEXT = 320


def make_backend(phase: str, **kwargs: Any):
    from cuda_graph_runner_breakable.backend import BreakableCudaGraphBackend

    device = torch.device(DEVICE)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return BreakableCudaGraphBackend(str(device), phase=phase, **kwargs)


def make_model(dtype: torch.dtype = torch.float32) -> ReferenceLlamaForCausalLM:
    return reference_model("tiny", requests=63, context=CONTEXT, dtype=dtype, device=DEVICE, num_slots=16384)


@pytest.fixture(scope="module")
def model():
    return make_model()


def captured_prefill(model, max_tokens: int) -> PrefillCudaGraphRunner:
    runner = PrefillCudaGraphRunner(
        model, {"prefill": {"max_bs": max_tokens}}, backend=make_backend("prefill"), show_progress=False
    )
    with torch.no_grad():
        runner.capture()
    return runner


@pytest.fixture(scope="module")
def prefill(model):
    runner = captured_prefill(model, MAX_TOKENS)
    yield runner
    runner.cleanup()


def kv_at(cache, slots: torch.Tensor) -> List[torch.Tensor]:
    return [buf[slots].clone() for buf in cache.k_buffers + cache.v_buffers]


def clear_kv(cache, slots: torch.Tensor) -> None:
    for buf in cache.k_buffers + cache.v_buffers:
        buf[slots] = 0


def check_prefill(runner, model, batch, *, replays: bool = True, atol: float = 1e-4, rtol: float = 1e-4) -> None:
    """Eager, then (after wiping this batch's KV slots) the runner: logits and KV must agree."""
    cache = model.kv_cache
    with torch.no_grad():
        expected = eager_logits_fn(model)(batch).clone()
        kv_expected = kv_at(cache, batch.out_cache_loc)
        clear_kv(cache, batch.out_cache_loc)  # the graph must write them again, at the live slots
        before = runner.backend.num_replays
        assert runner.can_run(batch) is replays, (
            batch.extend_seq_lens_cpu,
            runner.padded_size(batch.num_tokens) if batch.num_tokens <= runner.max_size else None,
        )
        got = runner.forward(batch).clone()
        assert runner.backend.num_replays == before + int(replays)
    lens = batch.extend_seq_lens_cpu
    assert got.shape == expected.shape == (len(lens), model.config.vocab_size)
    torch.testing.assert_close(got, expected, atol=atol, rtol=rtol, msg=lambda m: f"logits, lens {lens}: {m}")
    for i, (g, e) in enumerate(zip(kv_at(cache, batch.out_cache_loc), kv_expected)):
        torch.testing.assert_close(g, e, atol=atol, rtol=rtol, msg=lambda m: f"KV buffer {i}, lens {lens}: {m}")


def test_prefill_matches_eager_on_and_off_buckets_with_cached_prefixes(model, prefill):
    cache = model.kv_cache
    V = model.config.vocab_size
    rows: List[int] = []
    try:
        first = make_extend_batch(cache, make_dummy_prompts(2, [5, 11], V, seed=1))  # 16: on a bucket
        rows += first.req_pool_indices.tolist()
        check_prefill(prefill, model, first)

        fresh = make_extend_batch(cache, make_dummy_prompts(3, [20, 17, 1], V, seed=2))  # 38 -> 48
        rows += fresh.req_pool_indices.tolist()
        check_prefill(prefill, model, fresh)

        # Continue the first two requests (cached prefixes 5 and 11) next to a fresh one.
        new_row = cache.alloc_request()
        rows.append(new_row)
        mixed = make_extend_batch(cache, make_dummy_prompts(3, [7, 3, 22], V, seed=3), rows=rows[:2] + [new_row])
        assert mixed.extend_prefix_lens_cpu == [5, 11, 0] and mixed.num_tokens == 32  # on a bucket
        check_prefill(prefill, model, mixed)

        # Prefixes of every size, 109 tokens -> 112 (off the buckets).
        again = make_extend_batch(cache, make_dummy_prompts(6, [9, 4, 13, 40, 2, 41], V, seed=4), rows=rows)
        assert again.extend_prefix_lens_cpu == [12, 14, 20, 17, 1, 22]
        check_prefill(prefill, model, again)

        big = make_extend_batch(cache, make_dummy_prompts(3, [100, 128, 28], V, seed=5))  # 256: the maximum
        rows += big.req_pool_indices.tolist()
        check_prefill(prefill, model, big)

        one = make_extend_batch(cache, [[7]])  # 1 token -> 4: over 2x, eager
        rows += one.req_pool_indices.tolist()
        check_prefill(prefill, model, one, replays=False)

        over = make_extend_batch(cache, make_dummy_prompts(2, [150, 150], V, seed=6))  # 300 > 256: eager
        rows += over.req_pool_indices.tolist()
        check_prefill(prefill, model, over, replays=False)
    finally:
        for r in rows:
            cache.free_request(r)


def test_prefill_one_bucket_many_request_layouts(model, prefill):
    """The 48-token graph replayed with a new request layout each time: attention must see
    every replay's lengths and prefixes, never the capture's."""
    cache = model.kv_cache
    V = model.config.vocab_size
    layouts = [[48], [24, 24], [10, 20, 18], [1, 1, 46], [47], [3, 5, 7, 9, 11, 13], [40, 8], [48]]
    for i, lens in enumerate(layouts):
        rows = [cache.alloc_request() for _ in lens]
        try:
            if i % 2:  # odd steps: every request continues a cached prefix
                prefix = make_extend_batch(cache, make_dummy_prompts(len(lens), 6, V, seed=50 + i), rows=rows)
                with torch.no_grad():
                    eager_logits_fn(model)(prefix)
            batch = make_extend_batch(cache, make_dummy_prompts(len(lens), lens, V, seed=i), rows=rows)
            assert prefill.padded_size(batch.num_tokens) == 48
            check_prefill(prefill, model, batch)
        finally:
            for r in rows:
                cache.free_request(r)


def test_decode_matches_eager(model):
    cache = model.kv_cache
    V = model.config.vocab_size
    runner = DecodeCudaGraphRunner(
        model, {"decode": {"max_bs": 8}}, backend=make_backend("decode"), show_progress=False
    )
    eager = eager_logits_fn(model)
    try:
        with torch.no_grad():
            runner.capture()
            for bs in (1, 3, 5, 8):
                session = GreedySession(model, cache)
                session.prefill(make_dummy_prompts(bs, [2 + 5 * i for i in range(bs)], V, seed=bs))
                for step in range(3):
                    batch = next_decode_batch(session)
                    expected = eager(batch).clone()
                    assert runner.can_run(batch)
                    got = runner.forward(batch).clone()
                    torch.testing.assert_close(
                        got, expected, atol=1e-4, rtol=1e-4, msg=lambda m: f"decode bs {bs} step {step}: {m}"
                    )
                    session._pick(got[:bs])
                session.close()
        assert runner.backend.num_replays == 12
    finally:
        runner.cleanup()


def test_bfloat16_prefill_within_bf16_tolerance():
    model = make_model(torch.bfloat16)
    cache = model.kv_cache
    V = model.config.vocab_size
    runner = captured_prefill(model, 128)
    try:
        first = make_extend_batch(cache, make_dummy_prompts(3, [30, 7, 19], V, seed=7))  # 56 -> 64
        check_prefill(runner, model, first, atol=2e-2, rtol=2e-2)
        second = make_extend_batch(
            cache, make_dummy_prompts(3, [12, 40, 5], V, seed=8), rows=first.req_pool_indices.tolist()
        )  # 57 -> 64, with prefixes
        check_prefill(runner, model, second, atol=2e-2, rtol=2e-2)
    finally:
        runner.cleanup()
