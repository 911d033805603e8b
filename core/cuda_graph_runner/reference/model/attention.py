"""The marked eager op ``cuda_graph_runner::reference_llama_attention``: paged attention
over the live forward batch (capture-safe decode / target-verify / DLLM block extend,
per-request extend)."""

from typing import Any, NamedTuple, Tuple

import torch
import torch.nn.functional as F

from ...backend.context import forward_scratch, get_forward_batch
from ...backend.forward_batch import ForwardBatch
from ...backend.graph_break import eager_op


@eager_op("reference_llama_attention", capture_safe=("decode", "target_verify", "dllm_extend"))
def reference_llama_attention(
    output: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    scaling: float,
    sliding_window: int = 0,
    last_layer: bool = True,
) -> None:
    """Paged attention over the live batch (``get_forward_batch()``), written into ``output``.

    Args:
        output: ``[num_tokens, num_heads * head_dim]``, model dtype; overwritten.
        q: ``[num_tokens, num_heads * head_dim]`` queries, RoPE applied.
        k_cache, v_cache: ``[num_slots, num_kv_heads, head_dim]`` of this layer, with
            this step's K/V already written.
        req_to_token: ``[max_reqs, max_context_len]`` int64.
        scaling: softmax scale (``head_dim ** -0.5``).
        sliding_window: keys older than ``sliding_window`` positions are masked; 0 = off.
        last_layer: the last attention of the forward, which frees the per-step decode
            metadata the first one made (so no tensor outlives the forward inside a
            graph capture, which CUDA-graph trees refuse).

    DECODE / TARGET_VERIFY / DLLM_EXTEND is capture-safe (static shapes, device metadata
    only); EXTEND loops over requests with the host lengths. DLLM_EXTEND's block of
    ``w`` tokens per request is bidirectional inside the block (every block query sees
    every block key) and causal to the cached prefix; TARGET_VERIFY is causal inside it.

    Raises:
        RuntimeError: no forward batch is set, or an EXTEND batch lacks lengths.
    """
    call = AttentionCall(output, q, k_cache, v_cache, req_to_token, scaling, sliding_window, get_forward_batch())
    if call.batch.forward_mode.is_decode_like():
        _decode_attention(call, last_layer)
    else:
        _extend_attention(call)


class AttentionCall(NamedTuple):
    """One call's arguments (see :func:`reference_llama_attention`) and the live batch."""

    output: torch.Tensor
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    req_to_token: torch.Tensor
    scaling: float
    sliding_window: int
    batch: ForwardBatch


def _decode_attention(call: AttentionCall, last_layer: bool) -> None:
    output, q, k_cache, v_cache, req_to_token, scaling, sliding_window, batch = call
    # Capture-safe: every shape comes from tensor shapes and the static width; every
    # value from device tensors. The whole max_context_len is gathered and masked.
    w = batch.num_tokens_per_req
    bs = batch.req_pool_indices.shape[0]
    _, kv_heads, d = k_cache.shape
    heads = q.shape[1] // d
    group = heads // kv_heads
    slots, mask = _decode_metadata(batch, req_to_token, group, sliding_window, q.dtype, release=last_layer)
    k = k_cache[slots].transpose(1, 2)  # [bs, kv_heads, L, d]
    v = v_cache[slots].transpose(1, 2)
    # GQA without copying K/V per query head: the `group` query heads sharing one KV head
    # become extra query rows of that head ([bs, kv_heads, group * w, d]).
    qg = q.view(bs, w, heads, d).transpose(1, 2).reshape(bs, kv_heads, group * w, d)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scaling)  # [bs, kv_heads, group*w, d]
    output.copy_(out.reshape(bs, heads, w, d).transpose(1, 2).reshape(bs * w, heads * d))


def _decode_metadata(
    batch: ForwardBatch,
    req_to_token: torch.Tensor,
    group: int,
    sliding_window: int,
    dtype: torch.dtype,
    *,
    release: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """KV slots ``[bs, L]`` int64 and the additive mask ``[bs, 1, group * w, L]`` of a
    decode-like batch (``dtype``, the queries': 0 where a key is visible, ``-inf`` where
    not), computed by the first layer of a forward and shared by the others through
    :func:`forward_scratch` (every layer has the same lengths and window): one set of
    index kernels per step instead of one per layer. The mask is the one
    ``scaled_dot_product_attention`` would make of the boolean mask, made once per step
    rather than by every layer's call. ``release`` (the last layer) drops them from the
    scratch."""
    scratch: dict[Any, Any] = forward_scratch()
    key = ("reference_llama_decode_metadata", group, sliding_window, dtype, req_to_token.data_ptr())
    cached = scratch.pop(key, None) if release else scratch.get(key)
    if cached is not None:
        return cached
    w = batch.num_tokens_per_req
    bs = batch.req_pool_indices.shape[0]
    ctx = req_to_token.shape[1]
    device = req_to_token.device
    slots = req_to_token[batch.req_pool_indices]  # [bs, L]
    # Query j of request i sits at seq_lens[i] - w + j. Clamping at 0 keeps key 0
    # visible to every query, so padded rows (seq_len 1 < w) never see an empty row (NaN);
    # real rows have seq_len >= w, where the clamp changes nothing.
    q_pos = (batch.seq_lens.to(torch.int64)[:, None] - w + torch.arange(w, device=device)).clamp_(min=0)
    k_pos = torch.arange(ctx, device=device)
    # The last key each query sees: its own position (causal), or the block's last one
    # for DLLM_EXTEND (bidirectional inside the block, causal to the prefix).
    q_last = q_pos[:, -1:].expand(bs, w) if batch.forward_mode.is_block_bidirectional() else q_pos
    mask = k_pos[None, None, :] <= q_last[:, :, None]  # [bs, w, L]
    if sliding_window > 0:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    visible = mask[:, None, None].expand(bs, 1, group, w, ctx).reshape(bs, 1, group * w, ctx)
    mask = torch.full(visible.shape, float("-inf"), dtype=dtype, device=device).masked_fill_(visible, 0.0)
    if not release:
        scratch[key] = (slots, mask)
    return slots, mask


def _extend_attention(call: AttentionCall) -> None:
    output, q, k_cache, v_cache, req_to_token, scaling, sliding_window, batch = call
    ext = batch.extend_seq_lens_cpu
    pre = batch.extend_prefix_lens_cpu
    # Host lists are the contract; fall back to a device sync when a builder left them out.
    if ext is None:
        if batch.extend_seq_lens is None:
            raise RuntimeError("EXTEND batch has neither extend_seq_lens_cpu nor extend_seq_lens")
        ext = batch.extend_seq_lens.tolist()
    if pre is None:
        pre = batch.extend_prefix_lens.tolist() if batch.extend_prefix_lens is not None else [0] * len(ext)
    _, kv_heads, d = k_cache.shape
    heads = q.shape[1] // d
    group = heads // kv_heads
    start = 0
    for i, (n, p) in enumerate(zip(ext, pre)):
        n, p = int(n), int(p)
        if n == 0:
            continue
        slots, mask = _extend_metadata(call, i, p, n, group)
        k = k_cache[slots].transpose(0, 1)  # [kv_heads, p+n, d]
        v = v_cache[slots].transpose(0, 1)
        # GQA without copying K/V per query head, as in decode: the `group` query heads
        # sharing one KV head become extra query rows of it ([kv_heads, group * n, d]).
        qi = q[start : start + n].view(n, kv_heads, group, d).permute(1, 2, 0, 3).reshape(kv_heads, group * n, d)
        out = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scaling)
        output[start : start + n] = out.view(kv_heads, group, n, d).permute(2, 0, 1, 3).reshape(n, heads * d)
        start += n
    # Padded tail tokens (a prefill runner's padding) belong to no request.
    output[start:].zero_()


def _extend_metadata(call: AttentionCall, i: int, p: int, n: int, group: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """KV slots ``[p + n]`` int64 of request ``i`` of an EXTEND batch (``p`` cached, ``n``
    new tokens) and its additive causal (and windowed) mask ``[group * n, p + n]`` in the
    queries' dtype, rows ordered (query head of the group, token): made by the first
    layer of the forward and shared by the others through :func:`forward_scratch`."""
    scratch: dict[Any, Any] = forward_scratch()
    key = (
        "reference_llama_extend_metadata",
        i,
        p,
        n,
        group,
        call.sliding_window,
        call.q.dtype,
        call.req_to_token.data_ptr(),
    )
    cached = scratch.get(key)
    if cached is not None:
        return cached
    device = call.q.device
    # index_select keeps the row index on the device (indexing with a 0-d tensor
    # would read it on the host: a sync inside every replay of a prefill graph).
    slots = call.req_to_token.index_select(0, call.batch.req_pool_indices[i : i + 1])[0, : p + n]
    q_pos = torch.arange(p, p + n, device=device)
    k_pos = torch.arange(p + n, device=device)
    visible = k_pos[None, :] <= q_pos[:, None]
    if call.sliding_window > 0:
        visible &= k_pos[None, :] > q_pos[:, None] - call.sliding_window
    visible = visible[None].expand(group, n, p + n).reshape(group * n, p + n)
    mask = torch.full(visible.shape, float("-inf"), dtype=call.q.dtype, device=device).masked_fill_(visible, 0.0)
    scratch[key] = (slots, mask)
    return slots, mask
