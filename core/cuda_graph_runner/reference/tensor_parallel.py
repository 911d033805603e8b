"""Tensor-parallel pieces of the reference model (Megatron-style sharding, vLLM's layout).

* q/k/v and gate/up are column-parallel: each rank holds its heads' rows (plain
  ``_Linear`` of local shape, no communication);
* o_proj and down_proj are row-parallel: :class:`RowParallelLinear` multiplies by its
  column shard and all-reduces, then adds the (replicated) bias once;
* KV heads are sharded when ``num_kv_heads >= tp`` and replicated otherwise: rank ``r``
  then holds KV head ``r // (tp // num_kv_heads)`` (vLLM's ``QKVParallelLinear``);
* the embedding and the LM head are vocab-parallel, the vocab padded up to a multiple
  of TP (:class:`VocabParallelEmbedding`, :func:`parallel_lm_logits`): the logits are
  gathered so every rank returns the full ``[tokens, vocab]``.

:class:`TPLayout` holds the shard arithmetic; :func:`shard_hf_tensor` cuts a rank's shard
out of a full Hugging Face tensor (or a safetensors slice, so a rank reads only its
shard) and :func:`shard_fused_param` cuts it out of a full fused parameter (random init
that matches TP=1 weights). Collectives come from :mod:`cuda_graph_runner.runner.distributed`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..runner.distributed import TPGroup, all_gather_last_dim, all_reduce

__all__ = [
    "RowParallelLinear",
    "TPLayout",
    "VocabParallelEmbedding",
    "parallel_lm_logits",
    "shard_fused_param",
    "shard_hf_tensor",
]


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """Per-rank sizes of a :class:`~cuda_graph_runner.reference.model.ModelConfig` at TP ``size``.

    Raises:
        ValueError: attention heads, KV heads or the intermediate size do not split over
            ``size`` ranks (names the values and what is accepted).
    """

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def of(cls, config: Any, tp: Optional[TPGroup]) -> "TPLayout":
        rank, size = (tp.rank, tp.size) if tp is not None else (0, 1)
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        problems = []
        if heads % size:
            problems.append(f"num_attention_heads={heads} is not a multiple of tp={size}")
        if kv >= size and kv % size:
            problems.append(f"num_key_value_heads={kv} is not a multiple of tp={size}")
        if kv < size and size % kv:
            problems.append(f"tp={size} is not a multiple of num_key_value_heads={kv} (needed to replicate them)")
        if config.intermediate_size % size:
            problems.append(f"intermediate_size={config.intermediate_size} is not a multiple of tp={size}")
        if problems:
            raise ValueError("tensor parallel size does not fit the model: " + "; ".join(problems))
        return cls(rank, size, heads, kv, config.head_dim, config.intermediate_size, config.vocab_size)

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def local_kv_heads(self) -> int:
        """KV heads a rank holds: a shard, or one replicated head when TP exceeds them."""
        return max(1, self.num_kv_heads // self.size)

    @property
    def kv_head_start(self) -> int:
        if self.num_kv_heads >= self.size:
            return self.rank * self.local_kv_heads
        return self.rank // (self.size // self.num_kv_heads)

    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size // self.size

    @property
    def padded_vocab(self) -> int:
        """The vocab rounded up to a multiple of TP (the padding rows are zeros)."""
        return -(-self.vocab_size // self.size) * self.size

    @property
    def local_vocab(self) -> int:
        return self.padded_vocab // self.size

    @property
    def vocab_start(self) -> int:
        return self.rank * self.local_vocab


def shard_hf_tensor(name: str, src: Any, lay: TPLayout) -> torch.Tensor:
    """This rank's shard of the full Hugging Face tensor ``name``.

    Args:
        name: e.g. ``model.layers.0.self_attn.q_proj.weight``.
        src: the full tensor, or a safetensors ``get_slice`` handle (then only the shard
            is read from disk).
        lay: the layout.

    Returns:
        The shard (a tensor; vocab shards padded with zero rows to ``local_vocab``).
    """
    d = lay.head_dim
    if re.search(r"\.q_proj\.(weight|bias)$", name):
        a = lay.rank * lay.local_heads * d
        return src[a : a + lay.local_heads * d]
    if re.search(r"\.[kv]_proj\.(weight|bias)$", name):
        a = lay.kv_head_start * d
        return src[a : a + lay.local_kv_heads * d]
    if re.search(r"\.(gate_proj|up_proj)\.weight$", name):
        a = lay.rank * lay.local_intermediate
        return src[a : a + lay.local_intermediate]
    if re.search(r"\.o_proj\.weight$", name):
        a = lay.rank * lay.local_heads * d
        return src[:, a : a + lay.local_heads * d]
    if re.search(r"\.down_proj\.weight$", name):
        a = lay.rank * lay.local_intermediate
        return src[:, a : a + lay.local_intermediate]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        a = lay.vocab_start
        part = src[a : min(a + lay.local_vocab, lay.vocab_size)] if a < lay.vocab_size else None
        if part is not None and part.shape[0] == lay.local_vocab:
            return part
        hidden = (
            part.shape[1]
            if part is not None
            else src.get_shape()[1]
            if not isinstance(src, torch.Tensor)
            else src.shape[1]
        )
        dtype = part.dtype if part is not None else torch.float32
        out = torch.zeros(lay.local_vocab, hidden, dtype=dtype)
        if part is not None:
            out[: part.shape[0]] = part
        return out
    return src[:]  # norms, o_proj bias: replicated


def shard_fused_param(name: str, full: torch.Tensor, lay: TPLayout) -> torch.Tensor:
    """This rank's shard of a full (TP=1) parameter of the reference model's own layout
    (fused ``qkv_proj`` rows ``[q; k; v]``, fused ``gate_up_proj`` rows ``[gate; up]``)."""
    q, kv, inter = lay.num_heads * lay.head_dim, lay.num_kv_heads * lay.head_dim, lay.intermediate_size
    if ".qkv_proj." in name:
        stem = name.replace(".qkv_proj.", ".{}.")
        parts = full.split([q, kv, kv])
        return torch.cat(
            [shard_hf_tensor(stem.format(p), t, lay) for p, t in zip(("q_proj", "k_proj", "v_proj"), parts)]
        )
    if ".gate_up_proj." in name:
        stem = name.replace(".gate_up_proj.", ".{}.")
        return torch.cat(
            [
                shard_hf_tensor(stem.format(p), t, lay)
                for p, t in zip(("gate_proj", "up_proj"), full.split([inter, inter]))
            ]
        )
    return shard_hf_tensor(name, full, lay)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_shard W_shard^T) + b``: the input's last dim is split over ranks.

    Args:
        in_features: this rank's input width (the full width / TP).
        out_features: the full output width.
        bias: a bias, replicated on every rank and added once after the sum.

    ``forward``: ``[tokens, in_features]`` -> ``[tokens, out_features]``, the weight's
    dtype. Megatron-LM / vLLM ``RowParallelLinear``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        tp: Optional[TPGroup],
    ):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None or not self.tp.is_parallel:
            return F.linear(x, self.weight, self.bias)
        y = all_reduce(F.linear(x, self.weight), self.tp)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the padded vocab) are split over ranks.

    Each rank looks up the ids in its range (others give zero rows) and the sum over
    ranks is the full lookup. ``weight``: ``[local_vocab, hidden]``.
    ``forward``: int ids ``[tokens]`` -> ``[tokens, hidden]``. vLLM's
    ``VocabParallelEmbedding``.
    """

    def __init__(self, lay: TPLayout, hidden: int, dtype: torch.dtype, device: torch.device, tp: Optional[TPGroup]):
        super().__init__()
        self.tp = tp
        self.start, self.local_vocab = lay.vocab_start, lay.local_vocab
        self.weight = nn.Parameter(
            torch.empty(lay.local_vocab, hidden, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.local_vocab)
        out = F.embedding(local.clamp(0, self.local_vocab - 1), self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return all_reduce(out, self.tp)


def parallel_lm_logits(
    hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, tp: Optional[TPGroup]
) -> torch.Tensor:
    """Full float32 logits ``[tokens, vocab_size]`` from a vocab shard ``weight``
    ``[local_vocab, hidden]``: local logits, gathered over ranks, padding cut."""
    local = F.linear(hidden, weight).float()
    return all_gather_last_dim(local, tp)[..., :vocab_size]
