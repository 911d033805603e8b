"""The reference model's fused layer ops against the spelled-out math they replace (CPU).

The fused forms (``F.rms_norm``, one rotary pass over q and k together, the decode mask
made additive once per step) must give the same numbers as the formulas they stand for:
bit for bit in float32, and in bfloat16 where the order of operations is kept. The op
counts check that the fused forms are what the forward runs."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from cuda_graph_runner.backend.context import forward_context
from cuda_graph_runner.reference.batches import make_decode_batch, make_dummy_prompts, make_extend_batch
from cuda_graph_runner.reference.model import PRESETS, ReferenceLlamaForCausalLM
from cuda_graph_runner.reference.model.layers import _RMSNorm
from cuda_graph_runner.reference.model.rope import _rotate_half, apply_rotary

#: GQA (8 query heads over 2 KV heads), three layers, a sliding window: every branch of the layer.
CONFIG = PRESETS["tiny"].__class__(num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, sliding_window=6)


def _hf_rms_norm(norm: _RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm.forward``."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight * xf.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_the_transformers_formula(dtype):
    norm = _RMSNorm(48, 1e-5, dtype, torch.device("cpu"))
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(48))
    x = 3 * torch.randn(5, 48).to(dtype)
    got = norm(x)
    assert got.dtype == dtype
    assert torch.equal(got, _hf_rms_norm(norm, x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_over_q_and_k_together_equals_each_apart(dtype):
    t, heads, kv_heads, d = 4, 8, 2, 16
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d).to(dtype)
    angle = torch.randn(t, 1, d)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.reshape(t, heads, d), k.reshape(t, kv_heads, d)
    qk = apply_rotary(qkv[:, : (heads + kv_heads) * d].view(t, -1, d), cos, sin)
    assert torch.equal(qk[:, :heads], q * cos + _rotate_half(q) * sin)
    assert torch.equal(qk[:, heads:], k * cos + _rotate_half(k) * sin)


def _unfused_forward(model: ReferenceLlamaForCausalLM, batch) -> torch.Tensor:
    """The decoder spelled out op by op: transformers' RMSNorm, q and k rotated apart,
    and the decode attention over the boolean mask (extend attention: the model's own)."""
    cache = model.kv_cache
    h = model.model.embed_tokens(batch.input_ids)
    freqs = batch.positions.float()[:, None] * model.inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(h.dtype)[:, None, :], emb.sin().to(h.dtype)[:, None, :]
    for layer in model.model.layers:
        attn = layer.self_attn
        t, d = h.shape[0], attn.head_dim
        q, k, v = attn.qkv_proj(_hf_rms_norm(layer.input_layernorm, h)).split(
            [attn.q_size, attn.kv_size, attn.kv_size], dim=-1
        )
        q, k = q.reshape(t, attn.num_heads, d), k.reshape(t, attn.num_kv_heads, d)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k_cache, v_cache = cache.k_buffers[attn.layer_id], cache.v_buffers[attn.layer_id]
        k_cache[batch.out_cache_loc] = k
        v_cache[batch.out_cache_loc] = v.reshape(t, attn.num_kv_heads, d)
        out = torch.empty(t, attn.q_size, dtype=h.dtype)
        if batch.forward_mode.is_decode_like():
            out.copy_(_bool_mask_decode(q.reshape(t, -1), k_cache, v_cache, cache.req_to_token, attn, batch))
        else:
            attn.attn_backend.forward(
                out, q.reshape(t, -1), k_cache, v_cache, cache.req_to_token, attn.scaling, attn.sliding_window, True
            )
        h = h + attn.o_proj(out)
        mlp = layer.mlp
        gate, up = mlp.gate_up_proj(_hf_rms_norm(layer.post_attention_layernorm, h)).chunk(2, dim=-1)
        h = h + mlp.down_proj(F.silu(gate) * up)
    return _hf_rms_norm(model.model.norm, h)


def _bool_mask_decode(q, k_cache, v_cache, req_to_token, attn, batch) -> torch.Tensor:
    """Decode attention (width 1) with the boolean mask handed to SDPA."""
    bs, (_, kv_heads, d) = batch.req_pool_indices.shape[0], k_cache.shape
    heads = q.shape[1] // d
    group = heads // kv_heads
    slots = req_to_token[batch.req_pool_indices]
    q_pos = batch.seq_lens.to(torch.int64)[:, None] - 1
    k_pos = torch.arange(req_to_token.shape[1])
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
        k_pos[None, None, :] > q_pos[:, :, None] - attn.sliding_window
    )
    mask = mask[:, None, None].expand(bs, 1, group, 1, k_pos.numel()).reshape(bs, 1, group, -1)
    qg = q.view(bs, 1, heads, d).transpose(1, 2).reshape(bs, kv_heads, group, d)
    out = F.scaled_dot_product_attention(
        qg, k_cache[slots].transpose(1, 2), v_cache[slots].transpose(1, 2), attn_mask=mask, scale=attn.scaling
    )
    return out.reshape(bs, heads * d)


def _model() -> ReferenceLlamaForCausalLM:
    model = ReferenceLlamaForCausalLM.from_config(CONFIG, seed=3, std=0.1)
    with torch.no_grad():  # non-trivial norm weights, so a scale in the wrong place shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    model.create_kv_cache(num_slots=96, max_reqs=4, max_context_len=24)
    return model


@torch.no_grad()
def test_fused_forward_equals_the_unfused_math_in_float32():
    fused, unfused = _model(), _model()
    prompts = make_dummy_prompts(3, [5, 9, 3], CONFIG.vocab_size, seed=2)
    rows = [1, 2, 3]  # the rows the prefill allocates (row 0 is the cache's reserved dummy)
    for step in range(4):
        got = []
        for model, forward in ((fused, fused.forward), (unfused, lambda b, m=unfused: _unfused_forward(m, b))):
            assert model.kv_cache is not None
            if step == 0:
                batch = make_extend_batch(model.kv_cache, prompts)
            else:
                batch = make_decode_batch(model.kv_cache, rows, None, [11 + step, 12 + step, 13 + step])
            with forward_context(batch):
                got.append(forward(batch))
        assert torch.equal(got[0], got[1]), f"step {step}: max diff {(got[0] - got[1]).abs().max()}"
    assert fused.kv_cache is not None and unfused.kv_cache is not None
    for a, b in zip(
        fused.kv_cache.k_buffers + fused.kv_cache.v_buffers, unfused.kv_cache.k_buffers + unfused.kv_cache.v_buffers
    ):
        assert torch.equal(a, b)


class _Calls(TorchFunctionMode):
    """Counts the torch functions a forward calls (outside custom ops' bodies)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def test_a_decode_step_runs_the_fused_ops(monkeypatch):
    sdpa, mask_dtypes = F.scaled_dot_product_attention, []

    def recording_sdpa(*args, **kwargs):
        mask_dtypes.append(kwargs["attn_mask"].dtype)
        return sdpa(*args, **kwargs)

    model = _model()
    assert model.kv_cache is not None
    prompts = make_dummy_prompts(2, [4, 6], CONFIG.vocab_size, seed=1)
    with forward_context(batch := make_extend_batch(model.kv_cache, prompts)):
        model.forward(batch)
    batch = make_decode_batch(model.kv_cache, [1, 2], None, [7, 8])
    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    with forward_context(batch), _Calls() as seen:
        model.forward(batch)
    layers = CONFIG.num_hidden_layers
    assert seen.calls["rms_norm"] == 2 * layers + 1  # each norm one op, none spelled out
    assert seen.calls["rsqrt"] == 0
    assert seen.calls["cat"] == 1 + layers  # the rotary table, then one rotation of q and k per layer
    # The mask goes to SDPA additive in the model dtype, made once per step: no layer converts it.
    assert mask_dtypes == [torch.float32] * layers


def _repeated_kv_extend(q, k_cache, v_cache, req_to_token, batch, scaling, window) -> torch.Tensor:
    """Extend attention with K/V repeated per query head and SDPA's boolean mask."""
    _, kv_heads, d = k_cache.shape
    heads = q.shape[1] // d
    out, start = torch.zeros_like(q), 0
    for i, (n, p) in enumerate(zip(batch.extend_seq_lens_cpu, batch.extend_prefix_lens_cpu)):
        slots = req_to_token[int(batch.req_pool_indices[i]), : p + n]
        k = k_cache[slots].transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
        v = v_cache[slots].transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
        q_pos, k_pos = torch.arange(p, p + n), torch.arange(p + n)
        mask = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
        qi = q[start : start + n].view(n, heads, d).transpose(0, 1)
        got = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scaling)
        out[start : start + n] = got.transpose(0, 1).reshape(n, heads * d)
        start += n
    return out


@torch.no_grad()
def test_extend_attention_without_repeated_kv_equals_the_repeated_form():
    model = _model()
    cache = model.kv_cache
    assert cache is not None
    first = make_extend_batch(cache, make_dummy_prompts(2, [6, 3], CONFIG.vocab_size, seed=4))
    with forward_context(first):
        model.forward(first)
    # A chunk continuing both requests: cached prefixes, the window cutting into them.
    batch = make_extend_batch(cache, make_dummy_prompts(2, [5, 8], CONFIG.vocab_size, seed=5), rows=[1, 2])
    attn = model.model.layers[0].self_attn
    q = torch.randn(batch.input_ids.shape[0], attn.q_size)
    k_cache, v_cache = cache.k_buffers[0], cache.v_buffers[0]
    with forward_context(batch):
        for layer in range(2):  # the second call reads the metadata the first one made
            got = torch.empty_like(q)
            attn.attn_backend.forward(
                got, q, k_cache, v_cache, cache.req_to_token, attn.scaling, attn.sliding_window, True
            )
            want = _repeated_kv_extend(
                q, k_cache, v_cache, cache.req_to_token, batch, attn.scaling, attn.sliding_window
            )
            assert torch.equal(got, want), f"call {layer}: max diff {(got - want).abs().max()}"
