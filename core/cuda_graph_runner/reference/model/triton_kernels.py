"""Triton paged attention kernels of the ``triton`` attention backend: split-KV decode
(with its merge) and extend. The algorithm, in plain PyTorch, is
:mod:`.paged_attention_model`; this module imports ``triton`` and is imported only when
the backend first runs (the optional extra ``cuda-graph-runner[triton]``).

Capture-safe by construction (decode-like modes): every grid and block size comes from
tensor shapes and constants (the batch size, the width, the heads, the split count
fixed per padded batch size), every length is read by the kernel from device tensors
(``seq_lens``, ``req_pool_indices``, the page table ``req_to_token``), and the
scratch buffers are allocated by the caller inside the forward (so inside a graph's
memory pool). The softmax scale is cast to fp32 inside the kernels (a caller tracing
them, as inductor does a user-defined kernel, may pass a Python float as fp64), and the
backend calls them through opaque custom ops
(:func:`.triton_attention.decode_attention_op`, :func:`.triton_attention.extend_attention_op`),
so no compiler traces into them at all. fp32 inputs use
``tl.dot(..., input_precision="ieee")`` (Triton's default is TF32 on Ampere and later).

With ``TRITON_INTERPRET=1`` set before this module is first imported, the kernels run in
Triton's interpreter on CPU tensors (small shapes; the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention_model import ExtendTile

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    Q,
    K,
    V,
    ReqToToken,
    ReqPool,
    SeqLens,
    PartO,
    PartLse,
    Out,
    stride_qt,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_rt,
    qk_scale,
    W: tl.constexpr,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BIDIR: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # fp32 whatever the caller passed: inductor hands a user kernel a Python float as fp64,
    # which would make the loop-carried softmax state fp64 (Triton refuses that).
    qk_scale = tl.cast(qk_scale, tl.float32)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)  # row = query token j * GROUP + group head g
    row_ok = rows < W * GROUP
    j = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    tok = b * W + j
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        Q + tok[:, None] * stride_qt + head[:, None] * HEAD_DIM + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    seq = tl.load(SeqLens + b).to(tl.int32)
    q_pos = tl.maximum(seq - W + j, 0)
    if BIDIR:
        q_last = tl.maximum(seq - 1, 0) + j * 0
    else:
        q_last = q_pos
    hi = tl.maximum(seq, 1)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(seq - W - WINDOW + 1, 0)
    chunk = tl.cdiv(hi - lo, NUM_SPLITS)
    start = lo + split * chunk
    end = tl.minimum(start + chunk, hi)
    row = tl.load(ReqPool + b).to(tl.int64)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        k_pos = n0 + tl.arange(0, BLOCK_N)
        k_ok = k_pos < end
        # The page walk: each key's slot from the request's row of the page table.
        slot = tl.load(ReqToToken + row * stride_rt + k_pos, mask=k_ok, other=0).to(tl.int64)
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(K + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        mask = k_ok[None, :] & (k_pos[None, :] <= q_last[:, None])
        if WINDOW > 0:
            mask = mask & (k_pos[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]
    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            Out + tok[:, None] * (HEADS * HEAD_DIM) + head[:, None] * HEAD_DIM + d[None, :],
            o.to(Out.dtype.element_ty),
            mask=out_mask,
        )
    else:
        lse = tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))
        part = (tok * HEADS + head) * NUM_SPLITS + split  # PartO [bs*W, HEADS, S, d]
        tl.store(PartO + part[:, None] * HEAD_DIM + d[None, :], o, mask=out_mask)
        tl.store(PartLse + part, lse, mask=row_ok)


@triton.jit
def _merge_kernel(
    PartO,
    PartLse,
    Out,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    base = (tok * HEADS + head) * NUM_SPLITS
    lse = tl.load(PartLse + base + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    o = tl.load(PartO + (base + s)[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    total = tl.maximum(tl.sum(w, 0), 1e-30)
    out = tl.sum(w[:, None] * o, 0) / total
    tl.store(Out + tok * (HEADS * HEAD_DIM) + head * HEAD_DIM + d, out.to(Out.dtype.element_ty), mask=d_ok)


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    ReqToToken,
    ReqPool,
    Tiles,
    Out,
    stride_qt,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_rt,
    qk_scale,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    qk_scale = tl.cast(qk_scale, tl.float32)  # as in _decode_split_kernel
    t = tl.program_id(0)
    head = tl.program_id(1)
    kvh = head // GROUP
    req = tl.load(Tiles + t * 5)
    tok0 = tl.load(Tiles + t * 5 + 1)
    pre = tl.load(Tiles + t * 5 + 2)
    ext = tl.load(Tiles + t * 5 + 3)
    m0 = tl.load(Tiles + t * 5 + 4)
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < ext
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    tok = (tok0 + rows).to(tl.int64)
    q = tl.load(
        Q + tok[:, None] * stride_qt + head * HEAD_DIM + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
    )
    q_pos = pre + rows
    # A tile of no tokens (the padding of a fixed tile grid) walks no key.
    hi = tl.where(ext > 0, pre + tl.minimum(m0 + BLOCK_M, ext), 0)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(pre + m0 - WINDOW + 1, 0)
    row = tl.load(ReqPool + req).to(tl.int64)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        k_pos = n0 + tl.arange(0, BLOCK_N)
        k_ok = k_pos < hi
        slot = tl.load(ReqToToken + row * stride_rt + k_pos, mask=k_ok, other=0).to(tl.int64)
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(K + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        mask = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            mask = mask & (k_pos[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        Out + tok[:, None] * (HEADS * HEAD_DIM) + head * HEAD_DIM + d[None, :],
        o.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def _precision(dtype: torch.dtype) -> "str | None":
    return "ieee" if dtype == torch.float32 else None  # Triton's default for 16-bit inputs


def _check_layout(output: torch.Tensor, q: torch.Tensor, *caches: torch.Tensor) -> None:
    # The kernels address heads as h * head_dim and the last dim with stride 1.
    if not output.is_contiguous() or q.stride(-1) != 1 or any(c.stride(-1) != 1 for c in caches):
        raise ValueError(
            "triton attention needs a contiguous output and q, K, V, req_to_token with a contiguous last dim; "
            f"got strides output {output.stride()}, q {q.stride()}, " + ", ".join(str(c.stride()) for c in caches)
        )


def _dims(q: torch.Tensor, k_cache: torch.Tensor):
    _, kv_heads, d = k_cache.shape
    heads = q.shape[1] // d
    return kv_heads, d, heads, heads // kv_heads, max(16, triton.next_power_of_2(d))


def decode_attention(
    output: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    width: int,
    num_splits: int,
    scaling: float,
    sliding_window: int = 0,
    bidirectional: bool = False,
    block_n: int = 64,
) -> None:
    """Split-KV paged decode attention of a decode-like batch into ``output``.

    Args:
        output: ``[bs * width, heads * d]`` contiguous, model dtype; overwritten.
        q: ``[bs * width, heads * d]`` (row stride free, last dim contiguous).
        k_cache, v_cache: ``[num_slots, kv_heads, d]`` (last dim contiguous).
        req_to_token: ``[max_reqs, max_context_len]`` int64 (last dim contiguous).
        req_pool_indices: ``[bs]`` int64; seq_lens: ``[bs]`` int32 (device).
        width: tokens per request; num_splits: fixed per padded batch size
            (:func:`.paged_attention_model.decode_num_splits`).
        bidirectional: DLLM_EXTEND's block.

    One launch of the split kernel (grid ``(bs, kv_heads, num_splits)``) and, when
    ``num_splits > 1``, one of the merge kernel (grid ``(bs * width, heads)``).

    Raises:
        ValueError: a tensor whose layout the kernels cannot address (strides named).
    """
    _check_layout(output, q, k_cache, v_cache, req_to_token)
    kv_heads, d, heads, group, block_d = _dims(q, k_cache)
    bs = req_pool_indices.shape[0]
    block_m = max(16, triton.next_power_of_2(group * width))
    if num_splits > 1:
        part_o = torch.empty(bs * width, heads, num_splits, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(bs * width, heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = output  # unused by the kernel
    _decode_split_kernel[(bs, kv_heads, num_splits)](
        q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, part_o, part_lse, output,
        q.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0), scaling * _LOG2E,
        W=width, GROUP=group, HEADS=heads, HEAD_DIM=d, WINDOW=sliding_window, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, BIDIR=bidirectional, PRECISION=_precision(q.dtype),
        num_warps=4, num_stages=2,
    )  # fmt: skip
    if num_splits > 1:
        _merge_kernel[(bs * width, heads)](
            part_o, part_lse, output,
            HEADS=heads, HEAD_DIM=d, BLOCK_D=block_d, NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), num_warps=1,
        )  # fmt: skip


def extend_tile_tensor(tiles: "list[ExtendTile]", device: torch.device) -> torch.Tensor:
    """The tile table as the extend kernel reads it: ``[n_tiles, 5]`` int32 on ``device``.

    On CUDA it goes through pinned memory without blocking: a copy from pageable memory
    synchronizes the stream, which would make the host wait for the forward's queued
    kernels at the first layer and lose its lead over the device."""
    host = torch.tensor([list(t) for t in tiles] or [[0] * 5], dtype=torch.int32)
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def extend_attention(
    output: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    tiles: torch.Tensor,
    num_tiles: int,
    *,
    scaling: float,
    sliding_window: int = 0,
    block_m: int = 64,
    block_n: int = 64,
) -> None:
    """Causal paged extend attention (cached prefixes, ragged requests, a window) into
    ``output`` ``[num_tokens, heads * d]`` (rows no tile covers are left as they are).

    ``tiles``: :func:`extend_tile_tensor` of
    :func:`.paged_attention_model.extend_tiles` with the same ``block_m``; one program
    per (tile, query head).

    Raises:
        ValueError: a tensor whose layout the kernels cannot address (strides named).
    """
    if num_tiles == 0:
        return
    _check_layout(output, q, k_cache, v_cache, req_to_token)
    kv_heads, d, heads, group, block_d = _dims(q, k_cache)
    _extend_kernel[(num_tiles, heads)](
        q, k_cache, v_cache, req_to_token, req_pool_indices, tiles, output,
        q.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0), scaling * _LOG2E,
        GROUP=group, HEADS=heads, HEAD_DIM=d, WINDOW=sliding_window, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION=_precision(q.dtype), num_warps=4, num_stages=2,
    )  # fmt: skip
