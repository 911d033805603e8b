"""The reference model's LoRA adapters and DLLM_EXTEND mode on the CPU: LoRA logits equal
a merged-weights reference (float32), DLLM_EXTEND logits equal a plain-PyTorch dense
forward with a bidirectional block, and the decode runner (recording backend) replays
both as eager computes them."""

from __future__ import annotations

import copy
from typing import List, Sequence

import pytest
import torch
import torch.nn.functional as F

from cuda_graph_runner.backend import ShapeKey
from cuda_graph_runner.backend.forward_batch import ForwardMode
from cuda_graph_runner.reference.batches import (
    eager_logits_fn,
    make_decode_batch,
    make_dllm_extend_batch,
    make_dummy_prompts,
    make_extend_batch,
    make_target_verify_batch,
)
from cuda_graph_runner.reference.model import LORA_IDS, PRESETS, ReferenceLlamaForCausalLM
from cuda_graph_runner.runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner
from cuda_graph_runner.testing.fakes import RecordingBackend
from cuda_graph_runner.testing.tolerances import model_tolerance

CONTEXT = 48
TOL = model_tolerance(PRESETS["tiny"], torch.float32, context_len=CONTEXT)


def tiny(adapters: int = 0, rank: int = 4) -> ReferenceLlamaForCausalLM:
    model = ReferenceLlamaForCausalLM.from_preset("tiny", dtype=torch.float32, seed=3)
    if adapters:
        model.add_lora_adapters(adapters, rank, alpha=2.0 * rank, seed=5)
    model.create_kv_cache(num_slots=12 * CONTEXT + 1, max_reqs=13, max_context_len=CONTEXT)
    return model


def merged(model: ReferenceLlamaForCausalLM, adapter: int) -> ReferenceLlamaForCausalLM:
    """A copy without adapters whose weights are ``W + scaling * B_a A_a`` (``-1``: plain ``W``)."""
    plain = copy.deepcopy(model)
    with torch.no_grad():
        for module in plain.modules():
            lora = getattr(module, "lora", None)
            if lora is not None:
                if adapter >= 0:
                    module.weight += lora.delta_weight(adapter)
                module.lora = None
    plain.num_lora_adapters = 0
    plain.create_kv_cache(num_slots=2 * CONTEXT + 1, max_reqs=2, max_context_len=CONTEXT)
    return plain


def prefill_then_decode(model, prompts, next_tokens, ids=None):
    """Eager prefill of ``prompts`` then one decode step; ``(rows, prefill logits, decode logits)``."""
    cache = model.kv_cache
    batch = make_extend_batch(cache, prompts)
    if ids is not None:
        batch.extra[LORA_IDS] = list(ids)
    run = eager_logits_fn(model)
    first = run(batch).clone()
    rows = batch.req_pool_indices.tolist()
    step = make_decode_batch(cache, rows, None, next_tokens)
    if ids is not None:
        step.extra[LORA_IDS] = torch.tensor(ids)  # a tensor this time: both forms are accepted
    return rows, first, run(step).clone()


def test_lora_logits_equal_merged_weights_reference():
    model = tiny(adapters=2)
    prompts = make_dummy_prompts(3, [5, 8, 3], model.config.vocab_size, seed=1)
    ids = [-1, 0, 1]
    nxt = [7, 11, 13]
    _, first, second = prefill_then_decode(model, prompts, nxt, ids)
    for i, adapter in enumerate(ids):
        ref = merged(model, adapter)
        _, ref_first, ref_second = prefill_then_decode(ref, [prompts[i]], [nxt[i]])
        torch.testing.assert_close(first[i], ref_first[0], **TOL, msg=f"prefill, adapter {adapter}")
        torch.testing.assert_close(second[i], ref_second[0], **TOL, msg=f"decode, adapter {adapter}")
    # The adapters change the logits far beyond the tolerance (the comparison can fail).
    base = merged(model, -1)
    _, base_first, _ = prefill_then_decode(base, [prompts[1]], [nxt[1]])
    assert (first[1] - base_first[0]).abs().max() > 100 * TOL["atol"]


def test_nolora_variant_skips_the_adapters_and_equals_adapter_free_batches():
    model = tiny(adapters=2)
    prompts = make_dummy_prompts(2, 4, model.config.vocab_size, seed=2)
    _, none_ids, _ = prefill_then_decode(model, prompts, [1, 2], ids=[-1, -1])
    _, no_extra, _ = prefill_then_decode(model, prompts, [1, 2])
    torch.testing.assert_close(none_ids, no_extra, rtol=0, atol=0)
    batch = make_extend_batch(model.kv_cache, [[1, 2], [3]])
    for ids, variant in (([-1, -1], "nolora"), ([-1, 1], "lora"), (torch.tensor([0, -1]), "lora"), (None, "nolora")):
        batch.extra[LORA_IDS] = ids
        assert model.graph_variant(batch) == variant, ids


def test_lora_ids_out_of_range_are_refused():
    model = tiny(adapters=2)
    batch = make_extend_batch(model.kv_cache, [[1, 2, 3]])
    batch.extra[LORA_IDS] = [2]
    with pytest.raises(ValueError, match=r"adapter indices \[2\] are not in -1 \(none\) .. 1"):
        eager_logits_fn(model)(batch)
    with pytest.raises(ValueError, match="not accepted"):
        tiny().add_lora_adapters(1, 2, targets=("lm_head",))


def dense_logits(model: ReferenceLlamaForCausalLM, tokens: Sequence[int], allowed: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: the whole sequence at once, no KV cache, attention under ``allowed``
    (``[L, L]`` bool, query x key); float32 logits ``[L, vocab]``."""
    c = model.config
    d, heads, kv_heads = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    L = len(tokens)
    x = model.model.embed_tokens.weight[torch.tensor(tokens)]
    freqs = torch.arange(L).float()[:, None] * model.inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]

    def rms(v, w):
        return w * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps))

    def rope(v):
        v1, v2 = v.chunk(2, dim=-1)
        return v * cos + torch.cat((-v2, v1), dim=-1) * sin

    for layer in model.model.layers:
        attn = layer.self_attn
        qkv = F.linear(rms(x, layer.input_layernorm.weight), attn.qkv_proj.weight, attn.qkv_proj.bias)
        q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        q, k = rope(q.view(L, heads, d)), rope(k.view(L, kv_heads, d))
        v = v.view(L, kv_heads, d)
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5
        probs = scores.masked_fill(~allowed[None], float("-inf")).softmax(dim=-1)
        out = torch.einsum("hqk,khd->qhd", probs, v).reshape(L, heads * d)
        x = x + F.linear(out, attn.o_proj.weight, attn.o_proj.bias)
        gate, up = F.linear(rms(x, layer.post_attention_layernorm.weight), layer.mlp.gate_up_proj.weight).chunk(2, -1)
        x = x + F.linear(F.silu(gate) * up, layer.mlp.down_proj.weight)
    x = rms(x, model.model.norm.weight)
    head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    return F.linear(x, head).float()


def block_mask(prefix: int, width: int) -> torch.Tensor:
    """Causal over the prefix; the block's queries see the whole prefix and the whole block."""
    L = prefix + width
    allowed = torch.ones(L, L, dtype=torch.bool).tril()
    allowed[prefix:, :] = True
    return allowed


def prefill(model, prompts) -> List[int]:
    batch = make_extend_batch(model.kv_cache, prompts)
    eager_logits_fn(model)(batch)
    return batch.req_pool_indices.tolist()


@pytest.mark.parametrize("width", [1, 4])
def test_dllm_extend_eager_logits_equal_a_dense_bidirectional_block_reference(width):
    model = tiny()
    prompts = make_dummy_prompts(3, [6, 2, 9], model.config.vocab_size, seed=4)
    blocks = make_dummy_prompts(3, width, model.config.vocab_size, seed=5)
    rows = prefill(model, prompts)
    batch = make_dllm_extend_batch(model.kv_cache, rows, blocks)
    assert batch.forward_mode is ForwardMode.DLLM_EXTEND and batch.num_tokens_per_req == width
    got = eager_logits_fn(model)(batch)
    assert got.shape == (3 * width, model.config.vocab_size)
    for i, (prompt, block) in enumerate(zip(prompts, blocks)):
        ref = dense_logits(model, prompt + block, block_mask(len(prompt), width))[len(prompt) :]
        torch.testing.assert_close(got[i * width : (i + 1) * width], ref, **TOL, msg=f"request {i}")


def test_dllm_block_differs_from_the_causal_target_verify_block():
    model = tiny()
    prompts = make_dummy_prompts(2, 5, model.config.vocab_size, seed=6)
    blocks = make_dummy_prompts(2, 4, model.config.vocab_size, seed=7)
    rows = prefill(model, prompts)
    dllm = eager_logits_fn(model)(make_dllm_extend_batch(model.kv_cache, rows, blocks)).clone()
    rows2 = prefill(model, prompts)
    causal = eager_logits_fn(model)(make_target_verify_batch(model.kv_cache, rows2, blocks))
    # The block's first token sees the whole block in DLLM, only itself in target-verify.
    assert (dllm.view(2, 4, -1)[:, 0] - causal.view(2, 4, -1)[:, 0]).abs().max() > 100 * TOL["atol"]


def runner_for(model, **kwargs) -> DecodeCudaGraphRunner:
    return DecodeCudaGraphRunner(
        model,
        {"decode": {"max_bs": 4}},
        device="cpu",
        backend=RecordingBackend("cpu", phase="decode"),
        show_progress=False,
        **kwargs,
    )


def test_decode_runner_replays_lora_mixed_batches_and_picks_nolora_without_adapters():
    model = tiny(adapters=2)
    runner = runner_for(model)
    assert runner.variants == ["nolora", "lora"]
    runner.capture()
    assert len(runner.captured_keys) == len(runner.capture_sizes) * 2 == 6
    cache = model.kv_cache
    for bs, ids, variant in ((3, [-1, 0, 1], "lora"), (4, [1, 1, -1, 0], "lora"), (3, [-1, -1, -1], "nolora")):
        rows = prefill(model, make_dummy_prompts(bs, 5, model.config.vocab_size, seed=bs))
        batch = make_decode_batch(cache, rows, None, [3] * bs)
        batch.extra[LORA_IDS] = ids
        got = runner.forward(batch).clone()
        assert runner.backend.events[-1] == ("replay", ShapeKey(4, f"decode|{variant}"))
        torch.testing.assert_close(got, eager_logits_fn(model)(batch), **TOL, msg=str(ids))
        for r in rows:
            cache.free_request(r)
    assert runner.run_stats()["eager_total"] == 0


@pytest.mark.parametrize("width", [2, 4])
def test_decode_runner_captures_dllm_extend_like_target_verify(width):
    model = tiny()
    runner = runner_for(model, mode="dllm_extend", num_tokens_per_req=width)
    runner.capture()
    assert runner.backend.captured() == [ShapeKey(s, f"dllm_extend:{width}") for s in (4, 2, 1)]
    cache = model.kv_cache
    for bs in (3, 4):  # padded and captured
        rows = prefill(model, make_dummy_prompts(bs, [4 + i for i in range(bs)], model.config.vocab_size, seed=bs))
        batch = make_dllm_extend_batch(cache, rows, make_dummy_prompts(bs, width, model.config.vocab_size, seed=9))
        assert runner.can_run(batch)
        got = runner.forward(batch).clone()
        torch.testing.assert_close(got, eager_logits_fn(model)(batch), **TOL, msg=f"bs={bs}")
        # A target-verify batch of the same width is another mode: eager, not this graph.
        assert not runner.can_run(batch.replace(forward_mode=ForwardMode.TARGET_VERIFY))
        for r in rows:
            cache.free_request(r)


def test_a_runner_without_model_inputs_refuses_to_capture_a_lora_model():
    model = tiny(adapters=1)
    backend = RecordingBackend("cpu", phase="prefill")
    runner = PrefillCudaGraphRunner(
        model, {"prefill": {"max_bs": 16}}, device="cpu", backend=backend, show_progress=False
    )
    with pytest.raises(RuntimeError, match="no 'lora_adapter_ids' static input"):
        runner.capture()
