"""Planned prefill (EXTEND) attention metadata: what a plan-based attention computes on
the host from a batch's request lengths, before a forward, a capture and every replay,
so that its kernels read only device buffers and a prefill graph with fixed request
slots (backend ``full``) replays the right computation for any live lengths.

Two layouts of one plan, both padded to a size fixed per graph:

* per token (:func:`token_tables`, for :func:`token_table_extend`, the CPU stand-in's
  capture-safe extend): each token's request index in the batch and query position;
  a padded token gets request 0 and position -1 (it sees no key; its output row is 0);
* per tile (:func:`padded_extend_tiles`, the ``triton`` extend kernel's grid): the
  tiles of :func:`~.paged_attention_model.extend_tiles` followed by empty tiles (no
  tokens, no prefix: a program that loads and stores nothing) up to
  :func:`max_extend_tiles`, the most tiles any batch of that many tokens and requests
  can need.

Zero-length requests (the sentinels a runner pads the request slots with) own no token
and no tile, so they change nothing; their rows of ``compute_logits`` are the model's
business (the reference model gives them zeros).

Source of the idea: sglang's full prefill graphs (``full_prefill_max_req`` request
slots padded with zero-length requests, attention planned outside the graph) and
FlashInfer's ``plan()`` / ``run()`` split.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.nn.functional as F

from .attention import AttentionCall
from .paged_attention_model import ExtendTile, extend_tiles


def token_tables(
    extend_seq_lens: Sequence[int], extend_prefix_lens: Sequence[int], num_tokens: int
) -> Tuple[List[int], List[int]]:
    """``(request index, query position)`` per token of an EXTEND batch of ``num_tokens``
    tokens (the live ones first, request by request; then padding: request 0, position
    -1). Requests of no new tokens own no entry.

    Raises:
        ValueError: the lists differ in length, a length is negative, or the requests
            hold more than ``num_tokens`` tokens.
    """
    if len(extend_seq_lens) != len(extend_prefix_lens):
        raise ValueError(
            f"extend_seq_lens has {len(extend_seq_lens)} entries, extend_prefix_lens {len(extend_prefix_lens)}"
        )
    req: List[int] = []
    pos: List[int] = []
    for i, (n, p) in enumerate(zip(extend_seq_lens, extend_prefix_lens)):
        n, p = int(n), int(p)
        if n < 0 or p < 0:
            raise ValueError(f"request {i}: extend_seq_len={n}, extend_prefix_len={p}; both must be >= 0")
        req.extend([i] * n)
        pos.extend(range(p, p + n))
    pad = num_tokens - len(req)
    if pad < 0:
        raise ValueError(f"the requests hold {len(req)} new tokens, more than the batch's {num_tokens}")
    return req + [0] * pad, pos + [-1] * pad


def max_extend_tiles(num_tokens: int, num_requests: int, block_m: int) -> int:
    """The most extend tiles a batch of ``num_tokens`` tokens over at most
    ``num_requests`` requests can need: each request adds at most one partial tile,
    ``sum ceil(n_i / block_m) <= ceil(num_tokens / block_m) + num_requests``."""
    return -(-num_tokens // block_m) + num_requests


def padded_extend_tiles(
    extend_seq_lens: Sequence[int], extend_prefix_lens: Sequence[int], block_m: int, num_tiles: int
) -> List[ExtendTile]:
    """:func:`~.paged_attention_model.extend_tiles` padded with empty tiles to ``num_tiles``.

    Raises:
        ValueError: the batch needs more than ``num_tiles`` tiles (and what
            :func:`~.paged_attention_model.extend_tiles` raises).
    """
    tiles = extend_tiles(extend_seq_lens, extend_prefix_lens, block_m)
    if len(tiles) > num_tiles:
        raise ValueError(f"the batch needs {len(tiles)} extend tiles, more than the planned {num_tiles}")
    return tiles + [ExtendTile(0, 0, 0, 0, 0)] * (num_tiles - len(tiles))


def host_to_device(values: Sequence[Sequence[int]] | Sequence[int], dst: torch.Tensor) -> None:
    """Copy a host list into ``dst`` in place without a host sync: from pinned memory on
    CUDA (the caching host allocator keeps it until the copy ran), plainly elsewhere."""
    src = torch.tensor(values, dtype=dst.dtype)
    if dst.device.type == "cuda":
        src = src.pin_memory()
    dst.copy_(src.view(dst.shape), non_blocking=True)


def token_table_extend(call: AttentionCall, tok_req: torch.Tensor, tok_pos: torch.Tensor) -> None:
    """Causal paged extend attention from a per-token plan (:func:`token_tables` on the
    device), into ``call.output``: fixed shapes, every value read from device tensors, so
    it is capture-safe with a replay hook that refreshes ``tok_req``/``tok_pos`` in place.

    Args:
        call: the layer's call; ``call.batch.req_pool_indices`` ``[requests]`` int64.
        tok_req, tok_pos: ``[num_tokens]`` int64 (request index in the batch, query
            position; -1: a padded token, whose output row is zeroed).

    Gathers the whole ``max_context_len`` of each token's request and masks it (the
    reference decode attention's layout, one query row per token): memory
    ``num_tokens x max_context_len`` keys, for small CPU models.
    """
    output, q, k_cache, v_cache, req_to_token, scaling, sliding_window, batch = call
    tokens = q.shape[0]
    _, kv_heads, d = k_cache.shape
    heads = q.shape[1] // d
    group = heads // kv_heads
    ctx = req_to_token.shape[1]
    rows = batch.req_pool_indices.index_select(0, tok_req)
    slots = req_to_token.index_select(0, rows)  # [T, ctx]
    k = k_cache[slots].transpose(1, 2)  # [T, kv_heads, ctx, d]
    v = v_cache[slots].transpose(1, 2)
    k_pos = torch.arange(ctx, device=q.device)
    valid = tok_pos >= 0
    mask = k_pos[None, :] <= tok_pos[:, None]
    if sliding_window > 0:
        mask &= k_pos[None, :] > tok_pos[:, None] - sliding_window
    mask |= ~valid[:, None] & (k_pos[None, :] == 0)  # a padded token sees key 0: no empty row (NaN)
    qg = q.view(tokens, kv_heads, group, d)  # GQA: a KV head's query heads are its rows
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask[:, None, None, :], scale=scaling)
    out = out.reshape(tokens, heads * d)
    output.copy_(torch.where(valid[:, None], out, torch.zeros((), dtype=out.dtype, device=out.device)))
