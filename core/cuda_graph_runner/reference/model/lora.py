"""Low-rank adapters (LoRA) for the reference model, served many at once: each request of a
batch picks one adapter (or none) by index, so one captured graph serves any mix.

Per projection ``y = x W^T`` a set of ``N`` adapters of rank ``r`` adds

    y += scaling * (x A_n^T) B_n^T          for the adapter n of x's request

with ``A_n`` ``[r, in]``, ``B_n`` ``[out, r]`` and ``scaling = alpha / r`` (Hu et al.,
*LoRA*, 2021). All adapters are applied in two GEMMs over their stacked weights
(``A`` ``[N*r, in]``, ``B`` ``[out, N*r]``) with a per-token 0/1 mask ``[T, N*r]``
selecting each token's adapter between them (a dense form of the segmented
GEMMs of S-LoRA / Punica that sglang's LoRA backends use): static shapes, device
tensors only, so it records into a graph, and a token with adapter ``-1`` (or a padded
request) gets exactly zero added.

The per-request adapter choice is the model-owned static input ``lora_adapter_ids``
(``[batch_size]`` int64, ``-1`` = none; :mod:`cuda_graph_runner.runner.static_inputs`):
a live batch carries it in ``batch.extra["lora_adapter_ids"]`` as a host list (no sync:
the model picks the graph variant on the host) or a tensor.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

#: The ``ForwardBatch.extra`` key (and model-owned static input) of per-request adapter indices.
LORA_IDS = "lora_adapter_ids"
#: Graph variants of a model with adapters (sglang's names): without and with the adapter kernels.
NOLORA, LORA = "nolora", "lora"
#: The projections adapters attach to by default (sglang's fused layout).
LORA_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LoRAAdapters(nn.Module):
    """``num_adapters`` adapters of rank ``rank`` for one ``in_features -> out_features`` projection.

    Attributes:
        lora_a: ``[num_adapters * rank, in_features]``; rows ``n*r:(n+1)*r`` are ``A_n``.
        lora_b: ``[out_features, num_adapters * rank]``; columns ``n*r:(n+1)*r`` are ``B_n``.
        scaling: ``alpha / rank``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_adapters: int,
        rank: int,
        alpha: float,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.num_adapters, self.rank = num_adapters, rank
        self.scaling = float(alpha) / rank
        width = num_adapters * rank
        self.lora_a = nn.Parameter(torch.zeros(width, in_features, dtype=dtype, device=device), requires_grad=False)
        self.lora_b = nn.Parameter(torch.zeros(out_features, width, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The adapters' addition ``[T, out]`` for ``x`` ``[T, in]`` under ``mask`` ``[T, N*r]`` (0/1, x's dtype)."""
        xa = torch.nn.functional.linear(x, self.lora_a) * mask
        return torch.nn.functional.linear(xa, self.lora_b) * self.scaling

    def delta_weight(self, adapter: int) -> torch.Tensor:
        """``scaling * B_n A_n`` ``[out, in]``: what merging adapter ``n`` adds to ``W``."""
        r = self.rank
        a = self.lora_a[adapter * r : (adapter + 1) * r]
        b = self.lora_b[:, adapter * r : (adapter + 1) * r]
        return (b.float() @ a.float()).to(self.lora_a.dtype) * self.scaling


def token_adapter_mask(ids: torch.Tensor, batch: Any, num_adapters: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """The 0/1 mask ``[num_tokens, num_adapters * rank]`` selecting each token's adapter.

    Args:
        ids: ``[batch_size]`` int64 adapter per request (``-1``, or anything outside
            ``[0, num_adapters)``: none).
        batch: the forward batch (its mode and widths spread the requests over tokens).

    Capture-safe for the fixed-width modes (a static repeat); EXTEND spreads by
    ``extend_seq_lens`` with a static ``output_size`` (no host sync).
    """
    ids = ids.to(torch.int64)
    if batch.forward_mode.is_decode_like():
        w = batch.num_tokens_per_req  # a static width: expand, no repeat counts to read back
        per_token = ids if w == 1 else ids[:, None].expand(ids.shape[0], w).reshape(-1)
    else:
        per_token = ids.repeat_interleave(batch.extend_seq_lens.to(torch.int64), output_size=batch.num_tokens)
    adapters = torch.arange(num_adapters, device=ids.device)
    onehot = (per_token[:, None] == adapters[None, :]).to(dtype)  # [T, N]
    tokens = onehot.shape[0]
    return onehot[:, :, None].expand(tokens, num_adapters, rank).reshape(tokens, num_adapters * rank)


def host_adapter_ids(value: Any, batch_size: int, num_adapters: int) -> Optional[Sequence[int]]:
    """A host list/tuple of adapter indices, checked (None for a tensor or None).

    Raises:
        ValueError: another length than the batch, or an index outside ``-1 .. num_adapters - 1``.
    """
    if not isinstance(value, (list, tuple)):
        return None
    if len(value) != batch_size:
        raise ValueError(f"extra[{LORA_IDS!r}] has {len(value)} entries for {batch_size} requests")
    bad = [i for i in value if not (-1 <= int(i) < num_adapters)]
    if bad:
        raise ValueError(f"extra[{LORA_IDS!r}]: adapter indices {bad} are not in -1 (none) .. {num_adapters - 1}")
    return value
