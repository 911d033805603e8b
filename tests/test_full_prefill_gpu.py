"""GPU: prefill ``full`` (one CUDA graph per token bucket, fixed request slots) with the
``triton`` attention, whose replay hook refills each graph's extend tile table.

* the extend kernel over a fixed tile grid (tiles padded with empty ones, zero-length
  requests among the live ones) writes exactly what the unpadded grid writes;
* the tiny reference model (float32, a sliding window): replay equals eager for ragged
  requests, chunked prefill over cached prefixes and a continuous-batching schedule;
  a batch of more requests than slots runs eagerly with its counted reason; the run
  statistics count the request-slot waste;
* llama-3.2-1b in bfloat16: replay equals eager within the model's tolerance, for 1
  request of 128 tokens and 4 requests of 512 tokens.

Run on the device machine: ``python -m pytest -m gpu tests/test_full_prefill_gpu.py``.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from cuda_graph_runner.reference.batches import eager_logits_fn, make_dummy_prompts, make_extend_batch
from cuda_graph_runner.reference.model import PRESETS, ReferenceLlamaForCausalLM
from cuda_graph_runner.reference.model.extend_plan import max_extend_tiles, padded_extend_tiles
from cuda_graph_runner.reference.model.paged_attention_model import extend_tiles
from cuda_graph_runner.runner import PrefillCudaGraphRunner
from cuda_graph_runner.runner.stats import REASON_SLOTS
from cuda_graph_runner.testing.tolerances import model_tolerance

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package (extra [triton])"),
]

KV_HEADS, HEAD_DIM, HEADS = 8, 64, 32  # llama-3.2-1b


def tiny_model(*, requests: int = 24, context: int = 96, window: int = 8) -> ReferenceLlamaForCausalLM:
    config = dataclasses.replace(PRESETS["tiny"], sliding_window=window)
    model = ReferenceLlamaForCausalLM.from_config(config, dtype=torch.float32, device="cuda", attention="triton")
    model.create_kv_cache(num_slots=requests * context + 1, max_reqs=requests + 1, max_context_len=context)
    return model


def full_runner(model, sizes, slots) -> PrefillCudaGraphRunner:
    config = {"prefill": {"backend": "full", "bs": list(sizes), "full_prefill_max_req": slots}}
    return PrefillCudaGraphRunner(model, config, show_progress=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_kernel_on_a_padded_tile_grid_writes_what_the_unpadded_grid_writes(dtype):
    from cuda_graph_runner.reference.model import triton_kernels

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, context = 6, 256
    slots = rows * context + 1
    k = torch.randn(slots, KV_HEADS, HEAD_DIM, device="cuda", generator=gen).to(dtype)
    v = torch.randn(slots, KV_HEADS, HEAD_DIM, device="cuda", generator=gen).to(dtype)
    r2t = (torch.randperm(slots - 1, device="cuda", generator=gen)[: rows * context] + 1).view(rows, context)
    ext, pre = [70, 0, 5, 0, 130, 0], [0, 40, 17, 0, 60, 9]  # zero-length requests, with and without prefixes
    tokens = 256
    q = torch.randn(tokens, HEADS * HEAD_DIM, device="cuda", generator=gen).to(dtype)
    req_pool = torch.arange(rows, dtype=torch.int64, device="cuda")
    outs = []
    for tiles in (
        extend_tiles(ext, pre, 64),
        padded_extend_tiles(ext, pre, 64, max_extend_tiles(tokens, rows, 64)),
    ):
        out = torch.zeros(tokens, HEADS * HEAD_DIM, dtype=dtype, device="cuda")
        table = triton_kernels.extend_tile_tensor(tiles, q.device)
        triton_kernels.extend_attention(
            out, q, k, v, r2t.to(torch.int64), req_pool, table, len(tiles), scaling=HEAD_DIM**-0.5
        )
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert outs[1][sum(ext) :].abs().sum() == 0 and outs[1][: sum(ext)].abs().sum() > 0


def test_tiny_model_replays_equal_eager_over_ragged_chunked_and_continuous_batches():
    model = tiny_model()
    cache, vocab = model.kv_cache, model.config.vocab_size
    runner = full_runner(model, [8, 16, 32, 64, 128], slots=4)
    eager = eager_logits_fn(model)
    with torch.no_grad():
        runner.capture()
        assert len(model.attn_backend.extend_states) == 5  # one tile table per token bucket
        # Ragged requests, then their second chunks (cached prefixes), then new prompts
        # joining running ones (a continuous-batching schedule), then too many requests.
        steps = [([5, 20, 1], None), ([30, 2, 9], "continue"), ([9, 9], "join"), ([1, 1, 1, 1, 1], None)]
        rows: list = []
        for step, (lens, how) in enumerate(steps):
            prompts = make_dummy_prompts(len(lens), lens, vocab, seed=step)
            if how == "continue":
                batch = make_extend_batch(cache, prompts, rows=rows)
            elif how == "join":
                batch = make_extend_batch(cache, prompts + [[3, 4, 5]], rows=[rows[0], rows[1], cache.alloc_request()])
            else:
                batch = make_extend_batch(cache, prompts)
            expected = eager(batch).clone()
            replays = runner.can_run(batch)
            got = runner.forward(batch)
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
            assert replays == (batch.batch_size <= 4), step
            rows = batch.req_pool_indices.tolist()
    stats = runner.run_stats()
    assert stats["replays"] == 3 and stats["eager_fallbacks"] == {REASON_SLOTS: 1}
    assert stats["request_slots"]["real_requests"] == 9 and stats["request_slots"]["padded_slots"] == 3
    runner.cleanup()
    assert not model.attn_backend.extend_states


@pytest.mark.parametrize("requests,tokens", [(1, 128), (4, 512)])
def test_bf16_llama_full_prefill_replay_equals_eager(requests, tokens):
    context = 1024
    model = ReferenceLlamaForCausalLM.from_preset(
        "llama-3.2-1b", dtype=torch.bfloat16, device="cuda", attention="triton"
    )
    model.create_kv_cache(num_slots=8 * context + 1, max_reqs=9, max_context_len=context)
    runner = full_runner(model, [tokens], slots=4)
    eager = eager_logits_fn(model)
    tol = model_tolerance(model.config, torch.bfloat16, context_len=tokens)
    with torch.no_grad():
        runner.capture()
        lens = [tokens // requests] * requests
        lens[0] -= 3  # ragged, and padded to the bucket
        batch = make_extend_batch(model.kv_cache, make_dummy_prompts(requests, lens, model.config.vocab_size, seed=1))
        expected = eager(batch).clone()
        assert runner.can_run(batch)
        got = runner.forward(batch).clone()
    torch.testing.assert_close(got, expected, **tol)
