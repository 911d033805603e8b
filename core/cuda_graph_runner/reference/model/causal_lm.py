"""The reference causal LM: :class:`ReferenceLlamaForCausalLM`, the model protocol the
runners drive (forward over a batch, logits, capture/replay hooks) over its KV cache."""

from typing import Any, Callable, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from ...backend.forward_batch import ForwardBatch, ForwardMode, StaticForwardBatch, last_token_rows
from ...runner.static_inputs import StaticInput
from ..kv_cache import PagedKVCache
from ..tensor_parallel import TPLayout, parallel_lm_logits, shard_fused_param
from .attention_backend import AttentionBackend, attached_kv_cache, make_attention_backend
from .config import PRESETS, ModelConfig
from .layers import _Backbone, _Linear
from .loading import HFCheckpointMixin
from .lora import LORA, LORA_IDS, LORA_TARGETS, NOLORA, LoRAAdapters, host_adapter_ids, token_adapter_mask
from .rope import compute_inv_freq

#: The model hooks the runners call (:mod:`cuda_graph_runner.runner.model_protocol`) and the
#: attention backend's method each one is.
_ATTENTION_HOOKS = {
    "init_forward_metadata": "init_forward_metadata",
    "init_forward_metadata_capture": "init_forward_metadata_capture_cuda_graph",
    "init_forward_metadata_replay": "init_forward_metadata_replay_cuda_graph",
    "cleanup_cuda_graph_state": "cleanup_cuda_graph_state",
}


class ReferenceLlamaForCausalLM(HFCheckpointMixin, nn.Module):
    """Llama / Qwen2 / Mistral decoder over a :class:`PagedKVCache`.

    Args:
        config: the shape.
        dtype: parameter and KV dtype (float32, bfloat16, float16).
        device: where parameters live.
        tp_group: a :class:`~cuda_graph_runner.runner.distributed.TPGroup` for tensor
            parallelism (this rank's shard of heads, MLP and vocab; see
            :mod:`cuda_graph_runner.reference.tensor_parallel`), or None for one process.
            Runners read it as ``model.tp_group``.
        dp_group: a :class:`~cuda_graph_runner.runner.dp_group.DPGroup` for the
            data-parallel attention layout: every rank holds the whole attention,
            embedding and LM head and runs its own requests through them; each MLP holds
            the rank's shard of the intermediate size and runs over every rank's rows
            between an all-gather and an all-reduce (the stand-in for expert
            parallelism), so the ranks' forwards must have the same rows (the runners
            pad them: :mod:`cuda_graph_runner.runner.data_parallel`). Runners read it as
            ``model.dp_group``. Not with ``tp_group``.
        attention: the attention backend's name
            (:data:`~.attention_backend.ATTENTION_BACKENDS`: ``"torch"``, ``"planned_standin"``);
            None: :data:`~.attention_backend.DEFAULT_ATTENTION` (``"torch"``, on every device).

    Parameters start uninitialised: use :meth:`from_preset`, :meth:`from_config`
    (random weights) or :meth:`from_pretrained` (a checkpoint).

    Attributes:
        config: the :class:`ModelConfig`.
        kv_cache: the attached :class:`PagedKVCache`, or ``None`` (assigning it tells the attention backend).
        num_lora_adapters: adapters added by :meth:`add_lora_adapters` (0: none).
        attn_backend: the :class:`~.attention_backend.AttentionBackend` every layer calls.
        init_forward_metadata, init_forward_metadata_capture, init_forward_metadata_replay,
        cleanup_cuda_graph_state: the runner's hooks (:mod:`cuda_graph_runner.runner.model_protocol`),
            the attention backend's methods; None when it plans nothing (``torch``). A
            subclass that defines one of them as a method keeps its own.

    Raises:
        ValueError: ``attention`` names no attention backend (lists the accepted ones).

    LoRA (:mod:`.lora`): after :meth:`add_lora_adapters`, a batch's
    ``extra["lora_adapter_ids"]`` (``[batch_size]``, ``-1`` = none) picks each request's
    adapter; the model then declares the graph variants ``("nolora", "lora")`` and the
    model-owned static input ``lora_adapter_ids`` to the runners, and records the
    adapter kernels only in the ``"lora"`` variant.
    """

    inv_freq: torch.Tensor  # a buffer (register_buffer in __init__)
    attn_backend: AttentionBackend
    kv_cache = attached_kv_cache()  # an assignment tells attn_backend (its hooks plan over this table)
    init_forward_metadata: Optional[Callable[[ForwardBatch], None]]
    init_forward_metadata_capture: Optional[Callable[[ForwardBatch], None]]
    init_forward_metadata_replay: Optional[Callable[[ForwardBatch], None]]
    cleanup_cuda_graph_state: Optional[Callable[..., None]]

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: Union[str, torch.device] = "cpu",
        tp_group: Any = None,
        attention: Optional[str] = None,
        dp_group: Any = None,
    ):
        super().__init__()
        device = torch.device(device)
        if tp_group is not None and dp_group is not None:
            raise ValueError(
                "tp_group and dp_group together: data parallelism with tensor parallelism is not supported"
            )
        self.config = config
        self.tp_group = tp_group
        self.dp_group = dp_group
        self.tp_layout = TPLayout.of(config, tp_group)  # raises ValueError when the heads do not split
        backend = make_attention_backend(attention)  # raises ValueError for an unknown name
        self.attn_backend = backend
        # The runner's metadata hooks, or None when the attention plans nothing (``torch``):
        # then the replay path costs the runner one None check. A subclass's own method wins.
        for hook, method in _ATTENTION_HOOKS.items():
            if getattr(type(self), hook, None) is None:
                setattr(self, hook, getattr(backend, method) if backend.plans else None)
        self.replans_prefill_graphs = backend.replans_prefill_graphs
        self.model = _Backbone(config, dtype, device, tp_group, backend, dp_group)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else _Linear(config.hidden_size, self.tp_layout.local_vocab, False, dtype, device)
        )
        self.register_buffer("inv_freq", compute_inv_freq(config).to(device), persistent=False)
        self.kv_cache = None
        self.num_lora_adapters = 0
        self.lora_rank = 0

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
        attention: Optional[str] = None,
        dp_group: Any = None,
    ) -> "ReferenceLlamaForCausalLM":
        """A model with random weights: normal(0, ``std``) matrices and biases, unit norms.

        The same seed on the same device type gives the same weights; with ``tp_group``
        (or ``dp_group``) each rank holds its shard of those same weights. ``attention``:
        as the class's.
        """
        model = cls(config, dtype=dtype, device=device, tp_group=tp_group, attention=attention, dp_group=dp_group)
        model.init_random_weights(seed=seed, std=std)
        return model

    @classmethod
    def from_preset(cls, name: str, **options: Any) -> "ReferenceLlamaForCausalLM":
        """A model of a :data:`PRESETS` shape with random weights: :meth:`from_config`
        of ``PRESETS[name]`` with the same keyword ``options`` (``dtype``, ``device``,
        ``seed``, ``std``, ``tp_group``, ``attention``; by default float32 on the CPU, seed 0,
        std 0.02, ``torch`` attention).

        Raises:
            KeyError: ``name`` is not a preset (the message lists them).
            TypeError: an option :meth:`from_config` does not take.
        """
        if name not in PRESETS:
            raise KeyError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
        return cls.from_config(PRESETS[name], **options)

    @torch.no_grad()
    def init_random_weights(self, *, seed: int = 0, std: float = 0.02) -> None:
        """Fill matrices, embeddings and biases with normal(0, ``std``); norms with 1."""
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        # TP/DP: draw the full (TP=1) tensors in TP=1 order and keep this rank's shard.
        full = (
            dict(type(self)(self.config, dtype=self.dtype, device="meta").named_parameters())
            if self.tp_group is not None or self.dp_group is not None
            else None
        )
        layout = self.tp_layout if self.dp_group is None else self._dp_mlp_layout()
        for name, param in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                param.fill_(1.0)
            elif full is not None:
                whole = torch.empty(full[name].shape, dtype=self.dtype, device=self.device).normal_(
                    0.0, std, generator=gen
                )
                if self.dp_group is None or ".mlp." in name:  # DP: only the MLP is split
                    whole = shard_fused_param(name, whole, layout)
                param.copy_(whole)
            else:
                param.normal_(0.0, std, generator=gen)

    def _dp_mlp_layout(self) -> TPLayout:
        """The DP layout's MLP split (intermediate rows/columns by DP rank) as a TPLayout."""
        c, dp = self.config, self.dp_group
        return TPLayout(
            dp.rank,
            dp.size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.intermediate_size,
            c.vocab_size,
        )

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

    # -- LoRA --------------------------------------------------------------------------

    @torch.no_grad()
    def add_lora_adapters(
        self,
        num_adapters: int,
        rank: int = 8,
        *,
        alpha: Optional[float] = None,
        seed: int = 1,
        std: float = 0.02,
        targets: Sequence[str] = LORA_TARGETS,
    ) -> None:
        """Attach ``num_adapters`` random LoRA adapters of rank ``rank`` to every layer's
        ``targets`` projections (``A`` ~ normal(0, 1/sqrt(in)), ``B`` ~ normal(0, ``std``):
        unlike training's zero ``B``, each adapter changes the logits visibly).

        Args:
            alpha: ``scaling = alpha / rank``; None means ``alpha = rank`` (scaling 1).

        Raises:
            ValueError: adapters already attached, a non-positive count or rank, an
                unknown target (lists the accepted ones), or a tensor-parallel model.
        """
        if self.num_lora_adapters:
            raise ValueError(f"the model already has {self.num_lora_adapters} LoRA adapters")
        if num_adapters < 1 or rank < 1:
            raise ValueError(f"num_adapters={num_adapters}, rank={rank}: both must be >= 1")
        unknown = sorted(set(targets) - set(LORA_TARGETS))
        if unknown:
            raise ValueError(f"LoRA targets {unknown} are not accepted; accepted: {list(LORA_TARGETS)}")
        if self.tp_group is not None or self.dp_group is not None:
            raise ValueError("LoRA adapters are not supported with tensor or data parallelism in the reference model")
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        for layer in self.model.layers:
            for holder in (layer.self_attn, layer.mlp):
                for name in targets:
                    linear = getattr(holder, name, None)
                    if linear is None:
                        continue
                    out_features, in_features = linear.weight.shape
                    adapters = LoRAAdapters(
                        in_features, out_features, num_adapters, rank, alpha or rank, self.dtype, self.device
                    )
                    adapters.lora_a.normal_(0.0, in_features**-0.5, generator=gen)
                    adapters.lora_b.normal_(0.0, std, generator=gen)
                    linear.lora = adapters
        self.num_lora_adapters, self.lora_rank = num_adapters, rank

    def graph_variants(self) -> Optional[List[str]]:
        """``["nolora", "lora"]`` with adapters, else None (one graph per size)
        (:mod:`cuda_graph_runner.runner.variants`)."""
        return [NOLORA, LORA] if self.num_lora_adapters else None

    def graph_variant(self, batch: ForwardBatch) -> str:
        """``"lora"`` when some request of ``batch`` uses an adapter, else ``"nolora"``.

        A host list in ``extra["lora_adapter_ids"]`` is read on the host; a device
        tensor costs one device-to-host sync (engines know the adapters on the host:
        pass a list).

        Raises:
            ValueError: a host list of another length or with an index out of range.
        """
        ids = batch.extra.get(LORA_IDS)
        if ids is None or not self.num_lora_adapters:
            return NOLORA
        listed = host_adapter_ids(ids, batch.batch_size, self.num_lora_adapters)
        if listed is not None:
            return LORA if any(int(i) >= 0 for i in listed) else NOLORA
        return LORA if bool((ids >= 0).any()) else NOLORA

    def static_inputs(self) -> List[StaticInput]:
        """The model-owned static inputs (:mod:`cuda_graph_runner.runner.static_inputs`):
        ``lora_adapter_ids`` (``[batch_size]`` int64, padded with ``-1``) with adapters."""
        if not self.num_lora_adapters:
            return []
        return [StaticInput(LORA_IDS, axis="batch", dtype=torch.int64, pad_value=-1)]

    def _lora_mask(self, batch: ForwardBatch) -> Optional[torch.Tensor]:
        """The per-token adapter mask of this forward, or None when it runs without adapters."""
        if not self.num_lora_adapters or batch.graph_variant == NOLORA:
            return None
        ids = batch.extra.get(LORA_IDS)
        if ids is None:
            if isinstance(batch, StaticForwardBatch) and not batch.graph_variant:
                # A runner without variants recorded the adapter-free code: its replays
                # would silently ignore any adapter a later batch asks for.
                raise RuntimeError(
                    "the model has LoRA adapters but this runner gives it no 'lora_adapter_ids' static input "
                    "(only the decode runner has graph variants and model-owned inputs): run this phase eagerly "
                    "(backend 'disabled') or without adapters"
                )
            return None
        if not isinstance(ids, torch.Tensor):
            host_ids = host_adapter_ids(ids, batch.batch_size, self.num_lora_adapters)
            if host_ids is None:
                raise TypeError(
                    f"extra[{LORA_IDS!r}] must be an int64 tensor or a list of adapter indices, got {type(ids).__name__}"
                )
            ids = torch.tensor(list(host_ids), dtype=torch.int64, device=self.device)
        elif ids.device != self.device:  # eager path: a host tensor of the engine's
            ids = ids.to(self.device)
        return token_adapter_mask(ids, batch, self.num_lora_adapters, self.lora_rank, self.dtype)

    # -- protocol ----------------------------------------------------------------------

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """``seq_lens`` of padded requests in decode graphs: the attention backend's."""
        return self.attn_backend.get_cuda_graph_seq_len_fill_value()

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
        lora = self._lora_mask(batch)
        for layer in self.model.layers:
            h = layer(h, cos, sin, batch, cache, lora)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Project hidden states to float32 logits.

        Args:
            hidden: ``[num_tokens, hidden_size]`` from :meth:`forward`.
            batch: the same batch.

        Returns:
            DECODE / TARGET_VERIFY / DLLM_EXTEND: ``[num_tokens, vocab_size]`` (every token).
            EXTEND: ``[batch_size, vocab_size]``, each request's last new token; a
            request of no new tokens (a zero-length sentinel of a prefill graph's request
            slots) gets a row of zeros, never a neighbour's row.
        """
        if batch.forward_mode == ForwardMode.EXTEND:
            assert batch.extend_seq_lens is not None  # EXTEND batches carry it
            hidden = last_token_rows(hidden, batch.extend_seq_lens)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.tp_group is not None:  # vocab shards, gathered: every rank returns [tokens, vocab]
            return parallel_lm_logits(hidden, weight, self.config.vocab_size, self.tp_group)
        return F.linear(hidden, weight).float()
