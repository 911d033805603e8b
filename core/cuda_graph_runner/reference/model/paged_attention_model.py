"""The algorithm of the ``triton`` attention kernels (:mod:`.triton_kernels`), in plain
PyTorch: the split count of a decode step, the key range of each split, the page walk
(``req_to_token`` read block by block, online softmax in base 2), the merge of the
splits, and the extend tile table. It runs on any device without Triton, so CI checks
the algorithm against the reference attention (:mod:`.attention`); the kernels are
then checked against this and against the reference on the device.

Split-KV decode (flash-decoding, Dao et al. 2023; sglang's ``decode_attention.py``):
each request's visible keys ``[lo, hi)`` are cut into ``num_splits`` equal chunks;
one program per (request, KV head, split) computes the unnormalised softmax of the
``group * width`` query rows of that KV head over its chunk (the GQA query heads share
each K/V load) and writes the normalised partial output and its log-sum-exp; a merge
weighs the partials by ``exp2(lse - max lse)``. The result of a request depends only
on its own length and on ``num_splits``, which depends only on the *padded* batch size
(:func:`decode_num_splits`): a replay of a captured size and an eager forward of a
batch that would pad to it reduce in the same order.
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

#: At most this many splits per request (sglang's ``max_kv_splits`` is 8-16; 32 keeps
#: a batch-1 step over a few KV heads at two waves of an H200's 132 SMs).
MAX_SPLITS = 32
#: A split covers at least this many keys of ``max_context_len``.
MIN_KEYS_PER_SPLIT = 16
#: Programs a decode step aims for (about two per SM on an H200).
TARGET_PROGRAMS = 256

_LOG2E = 1.4426950408889634


def decode_num_splits(
    padded_batch_size: int, num_kv_heads: int, max_context_len: int, target_programs: int = TARGET_PROGRAMS
) -> int:
    """The split count of a decode step of ``padded_batch_size`` requests: the largest
    power of two ``S <= MAX_SPLITS`` with ``padded_batch_size * num_kv_heads * S <=
    target_programs`` and ``S * MIN_KEYS_PER_SPLIT <= max_context_len`` (at least 1).

    Depends only on static values (the captured size, the model, the cache), never on
    live lengths, so it is fixed per captured size.

    Raises:
        ValueError: a size below 1.
    """
    for name, value in (("padded_batch_size", padded_batch_size), ("num_kv_heads", num_kv_heads)):
        if value < 1:
            raise ValueError(f"{name}={value}: must be >= 1")
    splits = 1
    while (
        splits * 2 <= MAX_SPLITS
        and padded_batch_size * num_kv_heads * splits * 2 <= target_programs
        and splits * 2 * MIN_KEYS_PER_SPLIT <= max_context_len
    ):
        splits *= 2
    return splits


def decode_key_range(seq_len: int, width: int, sliding_window: int) -> Tuple[int, int]:
    """Keys ``[lo, hi)`` any of a request's ``width`` query rows may see: query ``j`` sits
    at ``max(seq_len - width + j, 0)`` (the clamp keeps key 0 visible to padded rows,
    as the reference attention's), sees keys up to its position (up to the block's last
    one when block-bidirectional) and, with a window, none older than ``window - 1``
    positions before it."""
    hi = max(seq_len, 1)
    lo = max(seq_len - width - sliding_window + 1, 0) if sliding_window > 0 else 0
    return lo, hi


def split_bounds(lo: int, hi: int, num_splits: int, split: int) -> Tuple[int, int]:
    """Keys ``[start, end)`` of split ``split`` (empty when ``start >= end``)."""
    chunk = -(-(hi - lo) // num_splits)
    start = lo + split * chunk
    return start, min(start + chunk, hi)


def _walk(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    q_last: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    row: torch.Tensor,
    kv_head: int,
    start: int,
    end: int,
    scaling: float,
    sliding_window: int,
    block_n: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Online softmax of query rows ``q`` ``[M, d]`` (fp32) over keys ``[start, end)`` read
    from the page-table row ``row`` block by block: ``(normalised output [M, d], lse
    [M])``, lse in base 2 (``-inf`` for a row that saw no key)."""
    m_rows, d = q.shape
    m_i = torch.full((m_rows,), -math.inf)
    l_i = torch.zeros(m_rows)
    acc = torch.zeros(m_rows, d)
    for n0 in range(start, end, block_n):
        k_pos = torch.arange(n0, min(n0 + block_n, end))
        slots = row[k_pos]  # the page walk: one table read per key
        k = k_cache[slots, kv_head].float()
        v = v_cache[slots, kv_head].float()
        s = (q @ k.T) * (scaling * _LOG2E)
        mask = k_pos[None, :] <= q_last[:, None]
        if sliding_window > 0:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        s = s.masked_fill(~mask, -math.inf)
        m_new = torch.maximum(m_i, s.max(dim=1).values)
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp2(m_i - m_safe)
        p = torch.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + p.sum(dim=1)
        acc = acc * alpha[:, None] + p @ v
        m_i = m_new
    seen = l_i > 0
    out = torch.where(seen[:, None], acc / torch.where(seen, l_i, 1.0)[:, None], 0.0)
    lse = torch.where(seen, m_i + torch.log2(torch.where(seen, l_i, 1.0)), -math.inf)
    return out, lse


def merge_splits(partial_out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Merge split partials: ``partial_out`` ``[..., S, d]`` (each normalised over its
    split), ``lse`` ``[..., S]`` base-2 log-sum-exp (``-inf``: empty split) to
    ``[..., d]`` fp32, the softmax over the union of the splits."""
    m = lse.max(dim=-1, keepdim=True).values
    w = torch.exp2(lse - torch.where(torch.isinf(m), torch.zeros_like(m), m))
    return (w[..., None] * partial_out).sum(dim=-2) / w.sum(dim=-1, keepdim=True).clamp_min(1e-30)


class DecodePartials(NamedTuple):
    """What the split kernel writes: ``out`` ``[bs * width, heads, S, d]`` fp32 (each
    split normalised), ``lse`` ``[bs * width, heads, S]`` fp32 base 2."""

    out: torch.Tensor
    lse: torch.Tensor


def split_kv_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: Sequence[int],
    seq_lens: Sequence[int],
    *,
    width: int,
    num_splits: int,
    scaling: float,
    sliding_window: int = 0,
    bidirectional: bool = False,
    block_n: int = 16,
) -> DecodePartials:
    """The split kernel's work for a decode-like batch, program by program.

    Args:
        q: ``[bs * width, heads * d]`` queries (request-major, as the runner lays them out).
        k_cache, v_cache: ``[num_slots, kv_heads, d]``.
        req_to_token: ``[max_reqs, max_context_len]`` int64 page table (one slot per token).
        req_pool_indices, seq_lens: host lists of the batch (``seq_lens`` after this step).
        width: query tokens per request (1 decode, > 1 target-verify / DLLM block).
        bidirectional: DLLM_EXTEND (every block query sees the whole block).
    """
    _, kv_heads, d = k_cache.shape
    heads = q.shape[1] // d
    group = heads // kv_heads
    bs = len(seq_lens)
    qf = q.float().view(bs, width, heads, d)
    out = torch.zeros(bs * width, heads, num_splits, d)
    lse = torch.full((bs * width, heads, num_splits), -math.inf)
    for b in range(bs):
        seq = int(seq_lens[b])
        row = req_to_token[int(req_pool_indices[b])]
        j = torch.arange(width)
        q_pos = (seq - width + j).clamp(min=0)
        q_last = q_pos[-1:].expand(width) if bidirectional else q_pos
        lo, hi = decode_key_range(seq, width, sliding_window)
        for kvh in range(kv_heads):
            # Rows ordered (query token, group head): the GQA heads of one KV head together.
            rows = qf[b, :, kvh * group : (kvh + 1) * group].reshape(width * group, d)
            rp = q_pos.repeat_interleave(group)
            rl = q_last.repeat_interleave(group)
            for s in range(num_splits):
                start, end = split_bounds(lo, hi, num_splits, s)
                o, ls = _walk(rows, rp, rl, k_cache, v_cache, row, kvh, start, end, scaling, sliding_window, block_n)
                heads_of = slice(kvh * group, (kvh + 1) * group)
                out[b * width : (b + 1) * width, heads_of, s] = o.view(width, group, d)
                lse[b * width : (b + 1) * width, heads_of, s] = ls.view(width, group)
    return DecodePartials(out, lse)


class ExtendTile(NamedTuple):
    """One program of the extend kernel (per query head): request ``req`` (its index in
    the batch), whose tokens start at ``token_start`` of the batch, with ``prefix``
    cached and ``extend`` new tokens; the tile covers new tokens ``[m_start, m_start +
    block_m)`` of it."""

    req: int
    token_start: int
    prefix: int
    extend: int
    m_start: int


def extend_tiles(extend_seq_lens: Sequence[int], extend_prefix_lens: Sequence[int], block_m: int) -> List[ExtendTile]:
    """The tile table of an EXTEND batch from its host lengths: ``ceil(extend / block_m)``
    tiles per request, requests in batch order (a request of 0 new tokens gets none).

    Raises:
        ValueError: the lists differ in length, or a length is negative.
    """
    if len(extend_seq_lens) != len(extend_prefix_lens):
        raise ValueError(
            f"extend_seq_lens has {len(extend_seq_lens)} entries, extend_prefix_lens {len(extend_prefix_lens)}"
        )
    tiles: List[ExtendTile] = []
    start = 0
    for b, (n, p) in enumerate(zip(extend_seq_lens, extend_prefix_lens)):
        n, p = int(n), int(p)
        if n < 0 or p < 0:
            raise ValueError(f"request {b}: extend_seq_len={n}, extend_prefix_len={p}; both must be >= 0")
        tiles.extend(ExtendTile(b, start, p, n, m) for m in range(0, n, block_m))
        start += n
    return tiles


def extend_key_range(tile: ExtendTile, block_m: int, sliding_window: int) -> Tuple[int, int]:
    """Keys ``[lo, hi)`` the tile's query rows may see (causal, windowed)."""
    hi = tile.prefix + min(tile.m_start + block_m, tile.extend)
    lo = max(tile.prefix + tile.m_start - sliding_window + 1, 0) if sliding_window > 0 else 0
    return lo, hi


def tiled_extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: Sequence[int],
    tiles: Sequence[ExtendTile],
    *,
    scaling: float,
    sliding_window: int = 0,
    block_m: int = 16,
    block_n: int = 16,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The extend kernel's work, tile by tile and head by head: ``[num_tokens, heads * d]``
    fp32 (rows no tile covers, a runner's padding, are zero)."""
    _, kv_heads, d = k_cache.shape
    heads = q.shape[1] // d
    group = heads // kv_heads
    qf = q.float().view(q.shape[0], heads, d)
    result = torch.zeros(q.shape[0], heads, d) if out is None else out
    for tile in tiles:
        if tile.extend == 0:  # the padding of a fixed tile grid: no tokens, no keys walked
            continue
        rows = torch.arange(tile.m_start, min(tile.m_start + block_m, tile.extend))
        q_pos = tile.prefix + rows
        lo, hi = extend_key_range(tile, block_m, sliding_window)
        row = req_to_token[int(req_pool_indices[tile.req])]
        for h in range(heads):
            o, _ = _walk(
                qf[tile.token_start + rows, h], q_pos, q_pos, k_cache, v_cache, row, h // group,
                lo, hi, scaling, sliding_window, block_n,
            )  # fmt: skip
            result[tile.token_start + rows, h] = o
    return result.view(q.shape[0], heads * d)


class TorchKernels:
    """:mod:`.triton_kernels`' entry points (same arguments, same writes) computed by this
    module's functions: the CPU tests' stand-in for the kernels (``triton_attention._kernels``
    replaced by an instance), so the ``triton`` backend's own code runs without Triton.
    Reads the batch's device tensors on the host (not capture-safe). Counts the calls made
    while Dynamo traced (``traced_calls``: a compiler looking inside the ops) and the
    others (``calls``)."""

    def __init__(self) -> None:
        self.calls = 0
        self.traced_calls = 0

    def _count(self) -> None:
        if torch.compiler.is_compiling():
            self.traced_calls += 1
        else:
            self.calls += 1

    def decode_attention(
        self, output, q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, *,
        width, num_splits, scaling, sliding_window=0, bidirectional=False, block_n=64,
    ) -> None:  # fmt: skip
        self._count()
        parts = split_kv_decode(
            q, k_cache, v_cache, req_to_token, req_pool_indices.tolist(), seq_lens.tolist(),
            width=width, num_splits=num_splits, scaling=scaling, sliding_window=sliding_window,
            bidirectional=bidirectional,
        )  # fmt: skip
        output.copy_(merge_splits(parts.out, parts.lse).reshape_as(output))

    def extend_attention(
        self, output, q, k_cache, v_cache, req_to_token, req_pool_indices, tiles, num_tiles, *,
        scaling, sliding_window=0, block_m=64, block_n=64,
    ) -> None:  # fmt: skip
        self._count()
        table = [ExtendTile(*row) for row in tiles.tolist()[:num_tiles]]
        got = tiled_extend(
            q, k_cache, v_cache, req_to_token, req_pool_indices.tolist(), table,
            scaling=scaling, sliding_window=sliding_window, block_m=block_m,
        )  # fmt: skip
        covered = sum(t.extend for t in table if t.m_start == 0)
        output[:covered].copy_(got[:covered])

    @staticmethod
    def extend_tile_tensor(tiles, device) -> torch.Tensor:
        return torch.tensor([list(t) for t in tiles] or [[0] * 5], dtype=torch.int32, device=device)
