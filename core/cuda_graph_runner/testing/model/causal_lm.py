"""The reference causal LM: :class:`ReferenceLlamaForCausalLM`, the model protocol the
runners drive (forward over a batch, logits, capture/replay hooks) over its KV cache."""

from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from ...forward_batch import ForwardBatch, ForwardMode
from ..kv_cache import PagedKVCache
from ..tensor_parallel import TPLayout, parallel_lm_logits, shard_fused_param
from .config import PRESETS, ModelConfig
from .layers import _Backbone, _Linear
from .loading import HFCheckpointMixin
from .rope import compute_inv_freq


class ReferenceLlamaForCausalLM(HFCheckpointMixin, nn.Module):
    """Llama / Qwen2 / Mistral decoder over a :class:`PagedKVCache`.

    Args:
        config: the shape.
        dtype: parameter and KV dtype (float32, bfloat16, float16).
        device: where parameters live.
        tp_group: a :class:`~cuda_graph_runner.distributed.TPGroup` for tensor
            parallelism (this rank's shard of heads, MLP and vocab; see
            :mod:`cuda_graph_runner.testing.tensor_parallel`), or None for one process.
            Runners read it as ``model.tp_group``.

    Parameters start uninitialised: use :meth:`from_preset`, :meth:`from_config`
    (random weights) or :meth:`from_pretrained` (a checkpoint).

    Attributes:
        config: the :class:`ModelConfig`.
        kv_cache: the attached :class:`PagedKVCache`, or ``None``.
    """

    inv_freq: torch.Tensor  # a buffer (register_buffer in __init__)

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: Union[str, torch.device] = "cpu",
        tp_group: Any = None,
    ):
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.tp_group = tp_group
        self.tp_layout = TPLayout.of(config, tp_group)  # raises ValueError when the heads do not split
        self.model = _Backbone(config, dtype, device, tp_group)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else _Linear(config.hidden_size, self.tp_layout.local_vocab, False, dtype, device)
        )
        self.register_buffer("inv_freq", compute_inv_freq(config).to(device), persistent=False)
        self.kv_cache: Optional[PagedKVCache] = None

    # -- construction ------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @classmethod
    def from_config(
        cls,
        config: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: Union[str, torch.device] = "cpu",
        seed: int = 0,
        std: float = 0.02,
        tp_group: Any = None,
    ) -> "ReferenceLlamaForCausalLM":
        """A model with random weights: normal(0, ``std``) matrices and biases, unit norms.

        The same seed on the same device type gives the same weights; with ``tp_group``
        each rank holds its shard of those same weights.
        """
        model = cls(config, dtype=dtype, device=device, tp_group=tp_group)
        model.init_random_weights(seed=seed, std=std)
        return model

    @classmethod
    def from_preset(
        cls,
        name: str,
        *,
        dtype: torch.dtype = torch.float32,
        device: Union[str, torch.device] = "cpu",
        seed: int = 0,
        tp_group: Any = None,
    ) -> "ReferenceLlamaForCausalLM":
        """A model of a :data:`PRESETS` shape with random weights (std 0.02).

        Raises:
            KeyError: ``name`` is not a preset (the message lists them).
        """
        if name not in PRESETS:
            raise KeyError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
        return cls.from_config(PRESETS[name], dtype=dtype, device=device, seed=seed, tp_group=tp_group)

    @torch.no_grad()
    def init_random_weights(self, *, seed: int = 0, std: float = 0.02) -> None:
        """Fill matrices, embeddings and biases with normal(0, ``std``); norms with 1."""
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        # TP: draw the full (TP=1) tensors in TP=1 order and keep this rank's shard.
        full = (
            dict(type(self)(self.config, dtype=self.dtype, device="meta").named_parameters())
            if self.tp_group is not None
            else None
        )
        for name, param in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                param.fill_(1.0)
            elif full is not None:
                whole = torch.empty(full[name].shape, dtype=self.dtype, device=self.device).normal_(
                    0.0, std, generator=gen
                )
                param.copy_(shard_fused_param(name, whole, self.tp_layout))
            else:
                param.normal_(0.0, std, generator=gen)

    # -- KV cache ----------------------------------------------------------------------

    def create_kv_cache(self, num_slots: int, max_reqs: int, max_context_len: int) -> PagedKVCache:
        """Create a :class:`PagedKVCache` shaped for this model (its dtype and device),
        attach it as ``self.kv_cache`` and return it. Replaces any attached cache.

        Raises:
            ValueError: a size is too small (see :class:`PagedKVCache`).
        """
        c = self.config
        cache = PagedKVCache(
            c.num_hidden_layers,
            self.tp_layout.local_kv_heads,
            c.head_dim,
            num_slots,
            max_reqs,
            max_context_len,
            dtype=self.dtype,
            device=self.device,
        )
        self.kv_cache = cache
        return cache

    def attach_kv_cache(self, cache: PagedKVCache) -> None:
        """Use ``cache`` (made elsewhere) for every following forward.

        Raises:
            ValueError: its layers, heads, head_dim, dtype or device do not fit the model.
        """
        c = self.config
        want = (c.num_hidden_layers, self.tp_layout.local_kv_heads, c.head_dim, self.dtype, self.device)
        got = (cache.num_layers, cache.num_kv_heads, cache.head_dim, cache.dtype, cache.device)
        if want != got:
            raise ValueError(f"KV cache (layers, kv_heads, head_dim, dtype, device)={got} does not fit model {want}")
        self.kv_cache = cache

    # -- protocol ----------------------------------------------------------------------

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        """Hook before capturing ``batch``'s shape: nothing to prepare (metadata is read live)."""

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        """Hook before replaying with ``batch``: nothing to prepare."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the decoder on ``batch``; writes this step's K/V into ``self.kv_cache``.

        Must be called inside ``forward_context(batch)``.

        Returns:
            ``[num_tokens, hidden_size]`` hidden states after the final norm, model dtype.

        Raises:
            RuntimeError: no KV cache is attached, or no forward batch is set.
        """
        cache = self.kv_cache
        if cache is None:
            raise RuntimeError("no KV cache: call model.create_kv_cache(num_slots, max_reqs, max_context_len) first")
        h = self.model.embed_tokens(batch.input_ids)
        freqs = batch.positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(h.dtype)[:, None, :]  # [T, 1, head_dim], broadcast over heads
        sin = emb.sin().to(h.dtype)[:, None, :]
        for layer in self.model.layers:
            h = layer(h, cos, sin, batch, cache)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Project hidden states to float32 logits.

        Args:
            hidden: ``[num_tokens, hidden_size]`` from :meth:`forward`.
            batch: the same batch.

        Returns:
            DECODE / TARGET_VERIFY: ``[num_tokens, vocab_size]`` (every token).
            EXTEND: ``[batch_size, vocab_size]``, each request's last new token.
        """
        if batch.forward_mode == ForwardMode.EXTEND:
            assert batch.extend_seq_lens is not None  # EXTEND batches carry it
            last = torch.cumsum(batch.extend_seq_lens.to(torch.int64), dim=0) - 1
            hidden = hidden[last]
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.tp_group is not None:  # vocab shards, gathered: every rank returns [tokens, vocab]
            return parallel_lm_logits(hidden, weight, self.config.vocab_size, self.tp_group)
        return F.linear(hidden, weight).float()
