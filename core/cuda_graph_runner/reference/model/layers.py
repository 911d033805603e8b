"""The decoder's building blocks (sglang layout: fused ``qkv_proj`` and
``gate_up_proj``): linear, RMSNorm, attention, MLP, decoder layer and the backbone.
Parameters start uninitialised; the model fills them (random init or a checkpoint)."""

import torch
import torch.nn.functional as F
from torch import nn

from ...backend.forward_batch import ForwardBatch
from ..kv_cache import PagedKVCache
from ..tensor_parallel import RowParallelLinear, TPLayout, VocabParallelEmbedding
from .attention_backend import AttentionBackend, TorchAttention
from .config import ModelConfig
from .rope import apply_rotary


class _Linear(nn.Module):
    """``y = x W^T (+ b)`` with uninitialised parameters (filled by init or loading)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _project(linear: nn.Module, x: torch.Tensor, lora_mask: "torch.Tensor | None") -> torch.Tensor:
    """``linear(x)``, plus its LoRA adapters' addition (:mod:`.lora`) when it has adapters
    and the forward uses them (``lora_mask`` ``[T, N*r]``, None: no adapters this forward)."""
    y = linear(x)
    adapters = getattr(linear, "lora", None)
    if lora_mask is not None and adapters is not None:
        y = y + adapters(x, lora_mask)
    return y


class _RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``, ``x``'s dtype, in transformers' order:
        normalise in float32, cast back, then scale.

        ``F.rms_norm`` is one fused kernel on CUDA (PyTorch's ``_fused_rms_norm``) where the
        spelled-out formula is six to eight (upcast, pow, mean, add, rsqrt, mul, downcast),
        and its CPU and compiled form is that same formula. With ``weight`` it scales in
        float32 before the cast, which equals transformers' order only in float32; a
        narrower dtype scales after the cast, as transformers (and vLLM's kernel) do."""
        shape = (x.shape[-1],)
        if x.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x, shape, None, self.eps)


class _Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        dtype: torch.dtype,
        device: torch.device,
        tp=None,
        attn_backend: "AttentionBackend | None" = None,
    ):
        super().__init__()
        self.layer_id = layer_id
        self.attn_backend = attn_backend if attn_backend is not None else TorchAttention()
        lay = TPLayout.of(config, tp)  # this rank's heads (all of them without TP)
        self.num_heads = lay.local_heads
        self.num_kv_heads = lay.local_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        self.sliding_window = config.sliding_window or 0
        self.last_layer = layer_id == config.num_hidden_layers - 1
        self.qkv_proj = _Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias, dtype, device)
        self.o_proj = (
            _Linear(self.q_size, config.hidden_size, config.o_bias, dtype, device)
            if tp is None
            else RowParallelLinear(self.q_size, config.hidden_size, config.o_bias, dtype, device, tp)
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        cache: PagedKVCache,
        lora: "torch.Tensor | None" = None,
    ) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qkv = _project(self.qkv_proj, x, lora)  # [t, q_size + 2 * kv_size]
        # q and k sit side by side in the fused projection: one set of rotary kernels
        # rotates both heads at once ([t, heads + kv_heads, d]; views, no copy before it).
        qk = apply_rotary(qkv[:, : self.q_size + self.kv_size].view(t, -1, d), cos, sin)
        q = qk[:, : self.num_heads].reshape(t, self.q_size)  # a view: row stride heads + kv_heads
        k = qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, d)
        k_cache = cache.k_buffers[self.layer_id]
        v_cache = cache.v_buffers[self.layer_id]
        # Device index tensor: an index_put kernel, safe inside a graph capture.
        k_cache[batch.out_cache_loc] = k
        v_cache[batch.out_cache_loc] = v
        out = torch.empty(t, self.q_size, dtype=x.dtype, device=x.device)
        self.attn_backend.forward(
            out,
            q,
            k_cache,
            v_cache,
            cache.req_to_token,
            self.scaling,
            self.sliding_window,
            self.last_layer,
        )
        return _project(self.o_proj, out, lora)


class _MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, tp=None):
        super().__init__()
        self.intermediate_size = TPLayout.of(config, tp).local_intermediate
        self.gate_up_proj = _Linear(config.hidden_size, 2 * self.intermediate_size, False, dtype, device)
        self.down_proj = (
            _Linear(self.intermediate_size, config.hidden_size, False, dtype, device)
            if tp is None
            else RowParallelLinear(self.intermediate_size, config.hidden_size, False, dtype, device, tp)
        )

    def forward(self, x: torch.Tensor, lora: "torch.Tensor | None" = None) -> torch.Tensor:
        gate, up = _project(self.gate_up_proj, x, lora).chunk(2, dim=-1)
        return _project(self.down_proj, F.silu(gate) * up, lora)


class _DPMLP(_MLP):
    """The MLP of the data-parallel layout: this rank's shard of the intermediate size
    (``intermediate_size / dp``) over every rank's rows, between an all-gather of the
    rows and an all-reduce of the partial sums (:func:`~cuda_graph_runner.runner.dp_group.gathered_mlp`),
    standing in for expert parallelism: its collectives need every rank in step.
    ``forward``: ``[n, hidden]`` (the same ``n`` on every rank) -> ``[n, hidden]``."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, dp):
        nn.Module.__init__(self)
        self.dp = dp
        self.intermediate_size = dp_intermediate(config, dp)
        self.gate_up_proj = _Linear(config.hidden_size, 2 * self.intermediate_size, False, dtype, device)
        self.down_proj = _Linear(self.intermediate_size, config.hidden_size, False, dtype, device)

    def forward(self, x: torch.Tensor, lora: "torch.Tensor | None" = None) -> torch.Tensor:
        from ...runner.dp_group import gathered_mlp

        return gathered_mlp(x, super().forward, self.dp)


def dp_intermediate(config: ModelConfig, dp) -> int:
    """A rank's share of the MLP's intermediate size in the DP layout.

    Raises:
        ValueError: ``intermediate_size`` is not a multiple of the DP size (names both).
    """
    if config.intermediate_size % dp.size:
        raise ValueError(
            f"data parallel size does not fit the model: intermediate_size={config.intermediate_size} "
            f"is not a multiple of dp={dp.size}"
        )
    return config.intermediate_size // dp.size


class _DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        dtype: torch.dtype,
        device: torch.device,
        tp=None,
        attn_backend=None,
        dp=None,
    ):
        super().__init__()
        self.self_attn = _Attention(config, layer_id, dtype, device, tp, attn_backend)
        self.mlp = _MLP(config, dtype, device, tp) if dp is None else _DPMLP(config, dtype, device, dp)
        self.input_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, h, cos, sin, batch, cache, lora=None):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, batch, cache, lora)
        return h + self.mlp(self.post_attention_layernorm(h), lora)


class _Backbone(nn.Module):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device, tp=None, attn_backend=None, dp=None
    ):
        super().__init__()
        self.embed_tokens = (
            nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device, _freeze=True)
            if tp is None
            else VocabParallelEmbedding(TPLayout.of(config, tp), config.hidden_size, dtype, device, tp)
        )
        self.layers = nn.ModuleList(
            _DecoderLayer(config, i, dtype, device, tp, attn_backend, dp) for i in range(config.num_hidden_layers)
        )
        self.norm = _RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
