"""A reference Llama-family decoder (Llama, Qwen2, Mistral) over a paged KV cache.

The model the runners and backends are tested with. It follows Hugging Face
transformers' numerics (RMSNorm in float32, RoPE tables in float32, logits in float32)
so it can be checked against ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` /
``MistralForCausalLM`` on the same checkpoint, and sglang's layout (fused ``qkv_proj``
and ``gate_up_proj``, a token-major batch without a batch axis).

Model protocol used by the runners:

* ``forward(batch) -> [num_tokens, hidden]`` hidden states after the final norm; must
  run inside :func:`~cuda_graph_runner.forward_context.forward_context`.
* ``compute_logits(hidden, batch) -> float32 logits``.
* ``init_forward_metadata_capture(batch)`` / ``init_forward_metadata_replay(batch)``:
  no-ops here (the attention reads live metadata from the forward context).

KV cache ownership: the model holds at most one :class:`PagedKVCache` in
``model.kv_cache``; create it with :meth:`ReferenceLlamaForCausalLM.create_kv_cache`
(or attach one with :meth:`~ReferenceLlamaForCausalLM.attach_kv_cache`).

Each layer writes this step's K/V into the cache (``k_cache[out_cache_loc] = k``) and
then calls the marked eager op ``cuda_graph_runner::reference_llama_attention``.

A step is idempotent: running the same batch twice writes the same values into the same
slots and returns the same output, which verify mode (:mod:`cuda_graph_runner.verify`)
relies on when it re-runs a replayed step eagerly. Inside the captured forward the model
reads only device tensors of the batch; host lengths are read inside the marked
attention op only (EXTEND), so the host-value guard (:mod:`cuda_graph_runner.host_guard`)
never trips on it.
"""

import dataclasses
import json
import math
import os
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..forward_batch import ForwardBatch, ForwardMode
from ..forward_context import forward_scratch, get_forward_batch
from ..graph_break import eager_op
from .kv_cache import PagedKVCache
from .tensor_parallel import (
    RowParallelLinear, TPLayout, VocabParallelEmbedding, parallel_lm_logits, shard_fused_param, shard_hf_tensor,
)

__all__ = [
    "ModelConfig",
    "PRESETS",
    "SUPPORTED_MODEL_TYPES",
    "SUPPORTED_ROPE_TYPES",
    "ReferenceLlamaForCausalLM",
    "reference_llama_attention",
]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


# ----------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    Attributes:
        model_type: ``"llama"``, ``"qwen2"`` or ``"mistral"`` (informational).
        vocab_size, hidden_size, intermediate_size, num_hidden_layers: sizes.
        num_attention_heads, num_key_value_heads, head_dim: attention shape (GQA when
            ``num_key_value_heads < num_attention_heads``).
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base.
        rope_scaling: ``None`` (default RoPE) or a dict with ``rope_type="llama3"`` and
            ``factor``, ``low_freq_factor``, ``high_freq_factor``,
            ``original_max_position_embeddings``.
        tie_word_embeddings: the LM head reuses the embedding matrix.
        qkv_bias: q/k/v projections have a bias (Qwen2; Llama with ``attention_bias``).
        o_bias: the output projection has a bias (Llama with ``attention_bias``).
        sliding_window: attention window of every layer (Mistral), ``None`` for full.
        max_position_embeddings: informational.
    """

    model_type: str = "llama"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[Mapping[str, Any]] = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    sliding_window: Optional[int] = None
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type != "llama3":
                raise ValueError(
                    f"rope_scaling rope_type {rope_type!r} is not supported; accepted: {list(SUPPORTED_ROPE_TYPES)}"
                )
            missing = [k for k in _LLAMA3_KEYS if k not in self.rope_scaling]
            if missing:
                raise ValueError(f"llama3 rope_scaling lacks {missing}")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> "ModelConfig":
        """Read a Hugging Face ``config.json`` dict (transformers 4.x or 5.x layout).

        RoPE settings are read from ``rope_parameters`` (transformers 5) or from
        ``rope_theta`` + ``rope_scaling`` (4.x).

        Raises:
            ValueError: ``model_type`` is not one of :data:`SUPPORTED_MODEL_TYPES`, the
                rope type is not one of :data:`SUPPORTED_ROPE_TYPES`, ``hidden_act`` is not
                ``silu``, ``mlp_bias`` is set, Qwen2 sliding-window attention is enabled,
                or a required key is missing (each message names the value).
        """
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; accepted: {list(SUPPORTED_MODEL_TYPES)}"
            )
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} for {model_type}; accepted: ['silu']")
        if config.get("mlp_bias"):
            raise ValueError(f"mlp_bias=True is not supported ({model_type}); accepted: false")

        def need(key: str) -> Any:
            if config.get(key) is None:
                raise ValueError(f"{model_type} config lacks required key {key!r}")
            return config[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)

        # transformers 5 folds rope_theta into rope_parameters; 4.x keeps them apart.
        rope_params = dict(config.get("rope_parameters") or {})
        rope_theta = float(rope_params.get("rope_theta", config.get("rope_theta", 10000.0)))
        scaling = config.get("rope_scaling") or rope_params
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {rope_type!r} ({model_type}); accepted: {list(SUPPORTED_ROPE_TYPES)}"
            )
        rope_scaling = None
        if rope_type == "llama3":
            missing = [k for k in _LLAMA3_KEYS if k not in scaling]
            if missing:
                raise ValueError(f"llama3 rope scaling lacks {missing}")
            rope_scaling = {"rope_type": "llama3", **{k: scaling[k] for k in _LLAMA3_KEYS}}

        sliding_window = None
        if model_type == "mistral":
            sliding_window = config.get("sliding_window")
        elif model_type == "qwen2" and config.get("use_sliding_window"):
            raise ValueError(
                "qwen2 use_sliding_window=True is not supported (per-layer windows); accepted: false"
            )

        if model_type == "qwen2":
            qkv_bias, o_bias = True, False  # Qwen2 always has q/k/v biases
        elif model_type == "llama":
            qkv_bias = o_bias = bool(config.get("attention_bias", False))
        else:
            qkv_bias = o_bias = False

        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            sliding_window=int(sliding_window) if sliding_window else None,
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        )


PRESETS: Dict[str, ModelConfig] = {
    # CPU-friendly; untied, no bias.
    "tiny": ModelConfig(),
    # CPU-friendly Qwen2 flavour: tied embeddings and q/k/v bias.
    "tiny-qwen2": ModelConfig(
        model_type="qwen2", tie_word_embeddings=True, qkv_bias=True, rope_theta=1e6
    ),
    "llama-3.2-1b": ModelConfig(
        model_type="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=True,
        max_position_embeddings=131072,
    ),
    "qwen2.5-0.5b": ModelConfig(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        qkv_bias=True,
        max_position_embeddings=32768,
    ),
}


def compute_inv_freq(config: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim // 2]`` float32 on CPU, as transformers computes them."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if config.rope_scaling is None:
        return inv_freq
    s = config.rope_scaling
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


# -------------------------------------------------------------------------- attention


@eager_op("reference_llama_attention")
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

    DECODE / TARGET_VERIFY is capture-safe (static shapes, device metadata only);
    EXTEND loops over requests with the host lengths.

    Raises:
        RuntimeError: no forward batch is set, or an EXTEND batch lacks lengths.
    """
    batch = get_forward_batch()
    if batch.forward_mode.is_decode_like():
        _decode_attention(output, q, k_cache, v_cache, req_to_token, scaling, sliding_window, batch, last_layer)
    else:
        _extend_attention(output, q, k_cache, v_cache, req_to_token, scaling, sliding_window, batch)


def _decode_attention(
    output: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    scaling: float,
    sliding_window: int,
    batch: ForwardBatch,
    last_layer: bool,
) -> None:
    # Capture-safe: every shape comes from tensor shapes and the static width; every
    # value from device tensors. The whole max_context_len is gathered and masked.
    w = batch.num_tokens_per_req
    bs = batch.req_pool_indices.shape[0]
    _, kv_heads, d = k_cache.shape
    heads = q.shape[1] // d
    group = heads // kv_heads
    slots, mask = _decode_metadata(batch, req_to_token, group, sliding_window, release=last_layer)
    k = k_cache[slots].transpose(1, 2)  # [bs, kv_heads, L, d]
    v = v_cache[slots].transpose(1, 2)
    # GQA without copying K/V per query head: the `group` query heads sharing one KV head
    # become extra query rows of that head ([bs, kv_heads, group * w, d]).
    qg = q.view(bs, w, heads, d).transpose(1, 2).reshape(bs, kv_heads, group * w, d)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scaling)  # [bs, kv_heads, group*w, d]
    output.copy_(out.reshape(bs, heads, w, d).transpose(1, 2).reshape(bs * w, heads * d))


def _decode_metadata(
    batch: ForwardBatch, req_to_token: torch.Tensor, group: int, sliding_window: int, *, release: bool
) -> Tuple[torch.Tensor, torch.Tensor]:
    """KV slots ``[bs, L]`` int64 and the boolean mask ``[bs, 1, group * w, L]`` of a
    decode-like batch, computed by the first layer of a forward and shared by the others
    through :func:`forward_scratch` (every layer has the same lengths and window): one
    set of index kernels per step instead of one per layer. ``release`` (the last
    layer) drops them from the scratch."""
    scratch = forward_scratch()
    key = ("reference_llama_decode_metadata", group, sliding_window, req_to_token.data_ptr())
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
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [bs, w, L]
    if sliding_window > 0:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    mask = mask[:, None, None].expand(bs, 1, group, w, ctx).reshape(bs, 1, group * w, ctx)
    if not release:
        scratch[key] = (slots, mask)
    return slots, mask


def _extend_attention(
    output: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    scaling: float,
    sliding_window: int,
    batch: ForwardBatch,
) -> None:
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
    start = 0
    for i, (n, p) in enumerate(zip(ext, pre)):
        n, p = int(n), int(p)
        if n == 0:
            continue
        # Index with a 0-d device tensor: a gather on device, no host sync.
        slots = req_to_token[batch.req_pool_indices[i]][: p + n]
        k = k_cache[slots].transpose(0, 1)  # [kv_heads, p+n, d]
        v = v_cache[slots].transpose(0, 1)
        qi = q[start : start + n].view(n, heads, d).transpose(0, 1)  # [heads, n, d]
        q_pos = torch.arange(p, p + n, device=q.device)
        k_pos = torch.arange(p + n, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        if sliding_window > 0:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        if heads != kv_heads:
            k = k.repeat_interleave(heads // kv_heads, dim=0)
            v = v.repeat_interleave(heads // kv_heads, dim=0)
        out = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scaling)
        output[start : start + n] = out.transpose(0, 1).reshape(n, heads * d)
        start += n
    # Padded tail tokens (a prefill runner's padding) belong to no request.
    output[start:].zero_()


# ----------------------------------------------------------------------------- layers


class _Linear(nn.Module):
    """``y = x W^T (+ b)`` with uninitialised parameters (filled by init or loading)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers' order: normalise in float32, cast back, then scale.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, device: torch.device, tp=None):
        super().__init__()
        self.layer_id = layer_id
        lay = TPLayout.of(config, tp)  # this rank's heads (all of them without TP)
        self.num_heads = lay.local_heads
        self.num_kv_heads = lay.local_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim ** -0.5
        self.sliding_window = config.sliding_window or 0
        self.last_layer = layer_id == config.num_hidden_layers - 1
        self.qkv_proj = _Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias, dtype, device)
        self.o_proj = (_Linear(self.q_size, config.hidden_size, config.o_bias, dtype, device) if tp is None
                       else RowParallelLinear(self.q_size, config.hidden_size, config.o_bias, dtype, device, tp))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k_cache = cache.k_buffers[self.layer_id]
        v_cache = cache.v_buffers[self.layer_id]
        # Device index tensor: an index_put kernel, safe inside a graph capture.
        k_cache[batch.out_cache_loc] = k
        v_cache[batch.out_cache_loc] = v.reshape(t, self.num_kv_heads, self.head_dim)
        out = torch.empty(t, self.q_size, dtype=x.dtype, device=x.device)
        reference_llama_attention(
            out, q.reshape(t, self.q_size), k_cache, v_cache, cache.req_to_token, self.scaling, self.sliding_window,
            self.last_layer,
        )
        return self.o_proj(out)


class _MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, tp=None):
        super().__init__()
        self.intermediate_size = TPLayout.of(config, tp).local_intermediate
        self.gate_up_proj = _Linear(config.hidden_size, 2 * self.intermediate_size, False, dtype, device)
        self.down_proj = (_Linear(self.intermediate_size, config.hidden_size, False, dtype, device) if tp is None
                          else RowParallelLinear(self.intermediate_size, config.hidden_size, False, dtype, device, tp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class _DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, device: torch.device, tp=None):
        super().__init__()
        self.self_attn = _Attention(config, layer_id, dtype, device, tp)
        self.mlp = _MLP(config, dtype, device, tp)
        self.input_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, h, cos, sin, batch, cache):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, batch, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class _Backbone(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, tp=None):
        super().__init__()
        self.embed_tokens = (
            nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device, _freeze=True) if tp is None
            else VocabParallelEmbedding(TPLayout.of(config, tp), config.hidden_size, dtype, device, tp))
        self.layers = nn.ModuleList(_DecoderLayer(config, i, dtype, device, tp) for i in range(config.num_hidden_layers))
        self.norm = _RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


# ------------------------------------------------------------------------------ model


class ReferenceLlamaForCausalLM(nn.Module):
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

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu",
                 tp_group: Any = None):
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.tp_group = tp_group
        self.tp_layout = TPLayout.of(config, tp_group)  # raises ValueError when the heads do not split
        self.model = _Backbone(config, dtype, device, tp_group)
        self.lm_head = (
            None if config.tie_word_embeddings
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
        full = dict(type(self)(self.config, dtype=self.dtype, device="meta").named_parameters()) \
            if self.tp_group is not None else None
        for name, param in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                param.fill_(1.0)
            elif full is not None:
                whole = torch.empty(full[name].shape, dtype=self.dtype, device=self.device).normal_(0.0, std, generator=gen)
                param.copy_(shard_fused_param(name, whole, self.tp_layout))
            else:
                param.normal_(0.0, std, generator=gen)

    @classmethod
    @torch.no_grad()
    def from_pretrained(
        cls,
        path: Union[str, os.PathLike],
        *,
        dtype: torch.dtype = torch.float32,
        device: Union[str, torch.device] = "cpu",
        tp_group: Any = None,
    ) -> "ReferenceLlamaForCausalLM":
        """Load a Hugging Face checkpoint directory.

        Reads ``config.json`` and either ``model.safetensors`` or the shards listed in
        ``model.safetensors.index.json``; q/k/v and gate/up weights are fused. A
        ``lm_head.weight`` of a tied model and ``rotary_emb.inv_freq`` are ignored.
        With ``tp_group`` each rank reads only its shard of every tensor
        (:func:`~cuda_graph_runner.testing.tensor_parallel.shard_hf_tensor`).

        Raises:
            FileNotFoundError: no config.json, or no safetensors file/index.
            ValueError: unsupported config (see :meth:`ModelConfig.from_hf_config`),
                missing or unexpected tensors (named), or a tensor of the wrong shape.
        """
        path = os.fspath(path)
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"no config.json in {path}")
        with open(cfg_path) as f:
            config = ModelConfig.from_hf_config(json.load(f))

        index_path = os.path.join(path, "model.safetensors.index.json")
        single_path = os.path.join(path, "model.safetensors")
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map: Dict[str, str] = json.load(f)["weight_map"]
        elif os.path.isfile(single_path):
            from safetensors import safe_open

            with safe_open(single_path, framework="pt") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")

        model = cls(config, dtype=dtype, device=device, tp_group=tp_group)
        targets = model._hf_targets()
        ignored = {k for k in weight_map if k.endswith("rotary_emb.inv_freq")}
        if config.tie_word_embeddings:
            ignored.add("lm_head.weight")
        present = set(weight_map) - ignored
        missing = sorted(set(targets) - present)
        unexpected = sorted(present - set(targets))
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {path} does not match {config.model_type} model: "
                f"missing tensors {missing}; unexpected tensors {unexpected}"
            )

        from safetensors import safe_open

        by_file: Dict[str, List[str]] = {}
        for name in sorted(targets):
            by_file.setdefault(weight_map[name], []).append(name)
        for fname, names in by_file.items():
            with safe_open(os.path.join(path, fname), framework="pt") as f:
                for name in names:
                    dest = targets[name]
                    src = f.get_tensor(name) if tp_group is None else shard_hf_tensor(name, f.get_slice(name),
                                                                                       model.tp_layout)
                    if tuple(src.shape) != tuple(dest.shape):
                        raise ValueError(
                            f"tensor {name} in {fname} has shape {tuple(src.shape)}, expected {tuple(dest.shape)}"
                        )
                    dest.copy_(src.to(dtype))
        return model

    def _hf_targets(self) -> Dict[str, torch.Tensor]:
        """Hugging Face tensor name -> the view of our (fused) parameter it fills."""
        c = self.config
        t: Dict[str, torch.Tensor] = {
            "model.embed_tokens.weight": self.model.embed_tokens.weight.data,
            "model.norm.weight": self.model.norm.weight.data,
        }
        if self.lm_head is not None:
            t["lm_head.weight"] = self.lm_head.weight.data
        attn0 = self.model.layers[0].self_attn if len(self.model.layers) else None  # local (TP) sizes
        q, kv = (attn0.q_size, attn0.kv_size) if attn0 is not None else (c.q_size, c.kv_size)
        inter = self.tp_layout.local_intermediate
        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}."
            qkv = layer.self_attn.qkv_proj
            parts = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
            for hf, (a, b) in parts.items():
                t[p + f"self_attn.{hf}.weight"] = qkv.weight.data[a:b]
                if qkv.bias is not None:
                    t[p + f"self_attn.{hf}.bias"] = qkv.bias.data[a:b]
            t[p + "self_attn.o_proj.weight"] = layer.self_attn.o_proj.weight.data
            if layer.self_attn.o_proj.bias is not None:
                t[p + "self_attn.o_proj.bias"] = layer.self_attn.o_proj.bias.data
            gu = layer.mlp.gate_up_proj.weight.data
            t[p + "mlp.gate_proj.weight"] = gu[:inter]
            t[p + "mlp.up_proj.weight"] = gu[inter:]
            t[p + "mlp.down_proj.weight"] = layer.mlp.down_proj.weight.data
            t[p + "input_layernorm.weight"] = layer.input_layernorm.weight.data
            t[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight.data
        return t

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
            last = torch.cumsum(batch.extend_seq_lens.to(torch.int64), dim=0) - 1
            hidden = hidden[last]
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.tp_group is not None:  # vocab shards, gathered: every rank returns [tokens, vocab]
            return parallel_lm_logits(hidden, weight, self.config.vocab_size, self.tp_group)
        return F.linear(hidden, weight).float()
