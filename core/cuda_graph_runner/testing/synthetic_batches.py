"""EXTEND batches without a KV cache, for toy models in runner and backend tests.

:func:`make_extend_batch` allocates rows and slots in a :class:`PagedKVCache`; a toy model
has no cache, so its tests need only a well-formed batch with distinct values in every
field (a padding or copy mistake then changes the numbers). Decode batches of that kind:
:func:`cuda_graph_runner.testing.toy_model.decode_batch`.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ..backend.forward_batch import ForwardBatch, ForwardMode

__all__ = ["synthetic_extend_batch"]


def synthetic_extend_batch(
    lens: Sequence[int],
    prefix: Optional[Sequence[int]] = None,
    *,
    token_stride: int = 1,
    token_offset: int = 0,
    vocab: int = 16,
    input_ids: Optional[torch.Tensor] = None,
    first_slot: int = 1,
    device: Union[str, torch.device] = "cpu",
) -> ForwardBatch:
    """An EXTEND batch of ``len(lens)`` requests, request ``i`` adding ``lens[i]`` tokens
    after ``prefix[i]`` cached ones (default: no prefix).

    Args:
        token_stride, token_offset, vocab: token ``t`` of the batch is
            ``(t * token_stride + token_offset) % vocab``, unless ``input_ids`` is given.
        input_ids: ``[sum(lens)]`` int64 token ids to use as they are.
        first_slot: ``out_cache_loc`` is ``first_slot, first_slot + 1, ...`` (slot 0 is
            the padding slot).
        device: where the tensors live (built from host lists: never call it inside a
            capture).

    Returns:
        ``input_ids``/``positions``/``out_cache_loc`` ``[num_tokens]`` int64
        (positions continue each prefix); ``req_pool_indices`` ``[bs]`` int64, rows
        ``1..bs``; ``seq_lens`` (prefix + new), ``extend_seq_lens``, ``extend_prefix_lens``
        ``[bs]`` int32, with host copies.

    Raises:
        ValueError: ``prefix`` or ``input_ids`` of another length.
    """
    lens = list(lens)
    prefix = list(prefix) if prefix is not None else [0] * len(lens)
    if len(prefix) != len(lens):
        raise ValueError(f"synthetic_extend_batch: {len(prefix)} prefixes for {len(lens)} requests")
    tokens = sum(lens)
    if input_ids is None:
        input_ids = (torch.arange(tokens) * token_stride + token_offset) % vocab
    elif input_ids.shape != (tokens,):
        raise ValueError(f"synthetic_extend_batch: input_ids of shape {tuple(input_ids.shape)} for {tokens} tokens")
    seq = [p + n for p, n in zip(prefix, lens)]

    def i32(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int32, device=device)

    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        input_ids=input_ids.to(device),
        positions=torch.tensor(
            [p + j for p, n in zip(prefix, lens) for j in range(n)], dtype=torch.int64, device=device
        ),
        out_cache_loc=torch.arange(first_slot, first_slot + tokens, device=device),
        req_pool_indices=torch.arange(1, len(lens) + 1, device=device),
        seq_lens=i32(seq),
        extend_seq_lens=i32(lens),
        extend_prefix_lens=i32(prefix),
        seq_lens_cpu=seq,
        extend_seq_lens_cpu=lens,
        extend_prefix_lens_cpu=prefix,
    )
