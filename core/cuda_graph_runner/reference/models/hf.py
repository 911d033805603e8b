"""A Hugging Face transformers causal LM through the runners: :class:`HFCausalLM`.

transformers' own modeling code (``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
``MistralForCausalLM``, ``Qwen3ForCausalLM``) runs unchanged; only its attention is
replaced. The adapter registers an attention function with transformers'
``AttentionInterface`` under a name of its own (:data:`ATTN_IMPLEMENTATION`), so:

* every layer's attention writes its K/V into this library's
  :class:`~cuda_graph_runner.reference.kv_cache.PagedKVCache` (``k_cache[out_cache_loc] = k``)
  and calls one of the reference workload's attention backends by name
  (:mod:`cuda_graph_runner.reference.model.attention_backend`), each inside its own marked
  eager op: ``torch`` (``cuda_graph_runner::reference_llama_attention``), ``triton``
  (Triton paged kernels, ``cuda_graph_runner::triton_paged_attention``), ``flashinfer`` /
  ``flashinfer_tc`` (FlashInfer's wrappers, planned through the runner's metadata hooks,
  which the adapter forwards), so every runner and capture backend (full, breakable,
  tc_piecewise, ...) serves the model;
* transformers' mask code (``create_causal_mask``, ``create_sliding_window_causal_mask``)
  returns ``None`` before any of its host branches (``_ignore_causal_mask_sdpa``,
  ``find_packed_sequence_indices``, host sizes), because the name is not one of
  ``ALL_MASK_ATTENTION_FUNCTIONS`` (transformers' route for "custom attention without a
  mask"). :func:`check_mask_bypass` asserts this of the installed transformers.

A forward packs every request of the batch as one ``[1, num_tokens]`` row, with
``position_ids`` from the batch and ``use_cache=False`` (no ``DynamicCache`` or
``StaticCache``: their host-side lengths are what broke graph capture of HF models);
the paged cache and the batch's ``seq_lens`` / ``req_to_token`` say which keys each
token sees.

Refused, with an error naming the feature and the architecture
(:class:`UnsupportedHFModelError`): RoPE types computed on the host per step (dynamic,
longrope), logit softcapping, attention sinks, MLA, MoE, hybrid / linear attention, and
any architecture outside :data:`SUPPORTED_ARCHITECTURES`.

Needs ``pip install 'cuda-graph-runner[transformers]'`` (transformers 5.17 or later 5.x).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from ...backend.forward_batch import ForwardBatch, ForwardMode, last_token_rows
from ...config.exceptions import CudaGraphRunnerError
from ..kv_cache import PagedKVCache
from ..model.attention_backend import AttentionBackend, attached_kv_cache, make_attention_backend
from ..model.config import PRESETS, ModelConfig

#: The attention implementation name the adapter registers with transformers.
ATTN_IMPLEMENTATION = "cuda_graph_runner_paged"
#: transformers ``model_type`` values the adapter serves.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3")
#: RoPE types whose tables are fixed when the model is built (no host step per forward).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
#: The tested transformers range (the ``[transformers]`` extra).
TRANSFORMERS_RANGE = ">=5.17,<6"
INSTALL_HINT = "pip install 'cuda-graph-runner[transformers]'"


def preset_config_kwargs(preset: ModelConfig) -> Dict[str, Any]:
    """transformers config keyword arguments of the reference workload's ``preset``
    (:data:`~cuda_graph_runner.reference.model.config.PRESETS`): the same shape and
    numerics (RoPE base and scaling in transformers 5's ``rope_parameters``, RMSNorm
    epsilon, tied embeddings), so ``hf:`` models and the reference model share one
    source of truth. ``qkv_bias`` / ``o_bias`` become ``attention_bias`` (Qwen2's q/k/v
    bias is built into its modeling code); ``sliding_window`` is left to the architecture.
    """
    rope: Dict[str, Any] = {"rope_type": "default", "rope_theta": float(preset.rope_theta)}
    if preset.rope_scaling is not None:
        rope.update(dict(preset.rope_scaling))
    return dict(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        head_dim=preset.head_dim,
        rms_norm_eps=preset.rms_norm_eps,
        max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=preset.tie_word_embeddings,
        rope_parameters=rope,
    )


#: Tiny random-weight configs for ``bench --model hf:<arch>`` on the CPU and the tests
#: (seconds per architecture), as transformers config keyword arguments.
TINY_CONFIG: Dict[str, Any] = {**preset_config_kwargs(PRESETS["tiny"]), "max_position_embeddings": 512}
#: The checkpoint shapes (random weights) :func:`builtin_config` serves by name, from the
#: reference presets of the same names: ``llama-3.2-1b`` is ``bench --model hf:<arch>``'s
#: shape on CUDA.
SIZES: Dict[str, Dict[str, Any]] = {
    "tiny": TINY_CONFIG,
    "llama-3.2-1b": preset_config_kwargs(PRESETS["llama-3.2-1b"]),
    "qwen2.5-0.5b": preset_config_kwargs(PRESETS["qwen2.5-0.5b"]),
}
LLAMA_3_2_1B_CONFIG: Dict[str, Any] = SIZES["llama-3.2-1b"]
_ARCH_EXTRA: Dict[str, Dict[str, Any]] = {
    "llama": {},
    "qwen2": {"tie_word_embeddings": True},
    "mistral": {"sliding_window": 8},
    "qwen3": {},
}
_CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig", "qwen3": "Qwen3Config"}

_CPU_SLIDING_WINDOW = 8  # short enough that the tests' and CPU bench's contexts cross it


class UnsupportedHFModelError(CudaGraphRunnerError, ValueError):
    """An HF model uses a feature the adapter does not serve; the message names the
    feature, the architecture and what is accepted."""


class TransformersUnavailableError(CudaGraphRunnerError, RuntimeError):
    """transformers is not installed (the message gives the install line)."""


def transformers_available() -> bool:
    """True when transformers can be imported."""
    return importlib.util.find_spec("transformers") is not None


def _transformers() -> Any:
    if not transformers_available():
        raise TransformersUnavailableError(f"the Hugging Face adapter needs transformers: {INSTALL_HINT}")
    import transformers

    return transformers


# -- attention ------------------------------------------------------------------------------


class _PagedBinding:
    """What one HF attention module needs to reach the paged cache (a plain object, not
    an ``nn.Module``, so it adds no submodule to the HF model)."""

    __slots__ = ("adapter", "layer_id", "last_layer")

    def __init__(self, adapter: "HFCausalLM", layer_id: int, last_layer: bool) -> None:
        self.adapter = adapter
        self.layer_id = layer_id
        self.last_layer = last_layer


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    sliding_window: Optional[int] = None,
    forward_batch: Optional[ForwardBatch] = None,
    paged_kv_cache: Optional[PagedKVCache] = None,
    **kwargs: Any,
) -> Tuple[torch.Tensor, None]:
    """transformers' attention-function signature over the paged KV cache.

    Args:
        module: the HF attention module (bound by :class:`HFCausalLM`).
        query: ``[1, num_heads, num_tokens, head_dim]``, RoPE applied.
        key, value: ``[1, num_kv_heads, num_tokens, head_dim]``, this step's.
        attention_mask: must be None (the mask bypass); the batch's lengths mask instead.
        scaling: softmax scale; None: ``head_dim ** -0.5``.
        sliding_window: this layer's window (None or 0: full attention).
        forward_batch, paged_kv_cache: the batch and the cache, passed by
            :meth:`HFCausalLM.forward` through transformers' attention kwargs (arguments,
            not a context lookup, so Dynamo traces them as inputs).

    Returns:
        ``([1, num_tokens, num_heads, head_dim], None)`` in the query's dtype.

    Raises:
        RuntimeError: the module is not bound to an adapter, a mask was built (the
            installed transformers does not bypass it), or the batch is not packed
            as one row.
    """
    binding: Optional[_PagedBinding] = getattr(module, "_cgr_paged", None)
    del kwargs  # transformers' other attention kwargs (output flags, ...): nothing to do
    if binding is None:
        raise RuntimeError(
            f"attn_implementation {ATTN_IMPLEMENTATION!r} runs only inside an HFCausalLM (this module is not bound)"
        )
    if attention_mask is not None:
        raise RuntimeError(
            "transformers built an attention mask for the paged attention: the installed transformers does not "
            f"return early for a custom attention implementation (tested: transformers{TRANSFORMERS_RANGE})"
        )
    if query.shape[0] != 1:
        raise RuntimeError(f"the paged attention takes one packed row, got a batch of {query.shape[0]}")
    if forward_batch is None or paged_kv_cache is None:
        raise RuntimeError(
            "the paged attention needs forward_batch and paged_kv_cache (HFCausalLM.forward passes them)"
        )
    batch, cache = forward_batch, paged_kv_cache
    _, heads, t, d = query.shape
    k_cache = cache.k_buffers[binding.layer_id]
    v_cache = cache.v_buffers[binding.layer_id]
    # Device index tensor: an index_put kernel, safe inside a graph capture.
    k_cache[batch.out_cache_loc] = key[0].transpose(0, 1).to(k_cache.dtype)
    v_cache[batch.out_cache_loc] = value[0].transpose(0, 1).to(v_cache.dtype)
    q = query[0].transpose(0, 1).reshape(t, heads * d)
    out = torch.empty(t, heads * d, dtype=query.dtype, device=query.device)
    binding.adapter.attn_backend.forward(
        out,
        q,
        k_cache,
        v_cache,
        cache.req_to_token,
        float(scaling if scaling is not None else d**-0.5),
        int(sliding_window or 0),
        binding.last_layer,
    )
    return out.view(1, t, heads, d), None


def _register_attention() -> None:
    transformers = _transformers()
    transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def check_mask_bypass() -> None:
    """Assert that the installed transformers' mask code returns before its host branches
    for :data:`ATTN_IMPLEMENTATION`: the name is not a mask attention function, so
    ``create_causal_mask`` returns None.

    Raises:
        RuntimeError: it does not (a transformers release changed the route); the
            adapter would then run transformers' host-side mask branches inside a capture.
    """
    _register_attention()
    from transformers import masking_utils

    mapping = getattr(masking_utils.ALL_MASK_ATTENTION_FUNCTIONS, "_global_mapping", {})
    if ATTN_IMPLEMENTATION in mapping:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION!r} is a mask attention function of the installed transformers")


# -- refusals -------------------------------------------------------------------------------


def _rope_type(config: Any) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        types = {v.get("rope_type", v.get("type", "default")) for v in params.values()}  # per layer type
        bad = sorted(t for t in types if t not in SUPPORTED_ROPE_TYPES)
        return bad[0] if bad else "default"
    if isinstance(params, dict):
        return str(params.get("rope_type", params.get("type", "default")) or "default")
    return "default"


def unsupported_features(config: Any) -> List[str]:
    """The features of HF ``config`` that the adapter does not serve (empty: none)."""
    found: List[str] = []
    rope = _rope_type(config)
    if rope in ("dynamic", "longrope"):
        found.append(f"{rope} RoPE (its tables are recomputed from host comparisons each forward)")
    elif rope not in SUPPORTED_ROPE_TYPES:
        found.append(f"RoPE type {rope!r} (accepted: {list(SUPPORTED_ROPE_TYPES)})")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, key, None):
            found.append(f"softcapping ({key}={getattr(config, key)})")
    if getattr(config, "sinks", None) or "gpt_oss" in str(getattr(config, "model_type", "")):
        found.append("attention sinks")
    if getattr(config, "kv_lora_rank", None) or getattr(config, "q_lora_rank", None):
        found.append("MLA (multi-head latent attention: kv_lora_rank / q_lora_rank)")
    for key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size"):
        if getattr(config, key, None):
            found.append(f"MoE ({key}={getattr(config, key)})")
            break
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if other:
        found.append(f"hybrid / linear attention (layer_types {other})")
    for key in ("linear_attention", "linear_num_key_heads", "attn_type_list", "layers_block_type"):
        if getattr(config, key, None):
            found.append(f"hybrid / linear attention ({key})")
            break
    return found


def check_supported(config: Any) -> None:
    """Refuse an HF config the adapter cannot serve exactly.

    Raises:
        UnsupportedHFModelError: names the feature and the architecture (or the
            architecture and the accepted ones).
    """
    arch = getattr(config, "model_type", None)
    features = unsupported_features(config)
    if features:
        raise UnsupportedHFModelError(
            f"the Hugging Face adapter does not serve {arch!r} with {'; '.join(features)}; "
            f"supported architectures: {list(SUPPORTED_ARCHITECTURES)}, without these features"
        )
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedHFModelError(
            f"the Hugging Face adapter does not serve architecture {arch!r}; accepted: {list(SUPPORTED_ARCHITECTURES)}"
        )


def _check_modules(hf_model: Any) -> None:
    """What a config may not say but the built modules show: attention sinks (a
    ``sinks`` parameter) and a host-updated RoPE (the rotary module's ``rope_type``).

    Raises:
        UnsupportedHFModelError: names the feature, the module and the architecture.
    """
    arch = getattr(hf_model.config, "model_type", None)
    for name, module in hf_model.named_modules():
        if isinstance(getattr(module, "sinks", None), torch.Tensor):
            raise UnsupportedHFModelError(
                f"the Hugging Face adapter does not serve {arch!r} with attention sinks ({name})"
            )
        rope = getattr(module, "rope_type", None)
        if isinstance(rope, str) and rope in ("dynamic", "longrope"):
            raise UnsupportedHFModelError(f"the Hugging Face adapter does not serve {arch!r} with {rope} RoPE ({name})")


# -- configs --------------------------------------------------------------------------------


def builtin_config(arch: str, *, size: str = "tiny") -> Any:
    """A transformers config of ``arch`` (:data:`SUPPORTED_ARCHITECTURES`) for random
    weights, shaped as ``size`` (:data:`SIZES`: ``"tiny"`` for the CPU, or a checkpoint
    shape such as ``"llama-3.2-1b"`` / ``"qwen2.5-0.5b"``, exact to its reference preset).

    Raises:
        UnsupportedHFModelError: an unknown ``arch``.
        ValueError: an unknown ``size`` (lists the accepted ones).
    """
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedHFModelError(
            f"no built-in Hugging Face config for {arch!r}; accepted: {list(SUPPORTED_ARCHITECTURES)}"
        )
    if size not in SIZES:
        raise ValueError(f"size={size!r}; accepted: {', '.join(repr(k) for k in SIZES)}")
    transformers = _transformers()
    kwargs = dict(SIZES[size])
    kwargs.update(_ARCH_EXTRA[arch])
    if arch == "mistral" and size != "tiny":
        kwargs["sliding_window"] = 4096
    if arch != "qwen2":  # Qwen2's q/k/v bias is part of its modeling code
        preset = PRESETS.get(size, PRESETS["tiny"])
        kwargs["attention_bias"] = preset.qkv_bias or preset.o_bias
    return getattr(transformers, _CONFIG_CLASSES[arch])(**kwargs)


# -- the adapter ----------------------------------------------------------------------------


class HFCausalLM(nn.Module):
    """An HF causal LM (``PreTrainedModel`` with a ``.model`` decoder and ``.lm_head``)
    as a runner model (:mod:`cuda_graph_runner.runner.model_protocol`).

    Args:
        hf_model: the transformers model; its attention implementation is switched to
            :data:`ATTN_IMPLEMENTATION` (so keep a separate copy for an eager reference).
        attention: the reference workload's attention backend by name
            (:data:`~cuda_graph_runner.reference.model.attention_backend.ATTENTION_BACKENDS`);
            None: ``torch``.

    Attributes:
        hf_model: the wrapped model (in eval mode).
        config: its transformers config (``vocab_size``, ``num_hidden_layers``, ...).
        kv_cache: the attached :class:`PagedKVCache`, or None (assigning it tells the attention backend).
        attn_backend: the attention backend every layer calls.
        init_forward_metadata, init_forward_metadata_capture, init_forward_metadata_replay,
        cleanup_cuda_graph_state: the backend's hooks; None when it plans nothing.

    Raises:
        UnsupportedHFModelError: see :func:`check_supported`.
        ValueError: an unknown attention backend name.
        TransformersUnavailableError: transformers is not installed.
    """

    hf_model: Any  # a transformers PreTrainedModel (a submodule)
    config: Any  # its transformers PretrainedConfig
    kv_cache = attached_kv_cache()  # an assignment tells attn_backend (its hooks plan over this table)
    init_forward_metadata: Optional[Callable[[ForwardBatch], None]]
    init_forward_metadata_capture: Optional[Callable[[ForwardBatch], None]]
    init_forward_metadata_replay: Optional[Callable[[ForwardBatch], None]]
    cleanup_cuda_graph_state: Optional[Callable[..., None]]

    def __init__(self, hf_model: Any, *, attention: Optional[str] = None) -> None:
        super().__init__()
        config = hf_model.config
        check_supported(config)
        _check_modules(hf_model)
        backend: AttentionBackend = make_attention_backend(attention)
        _register_attention()
        self.hf_model = hf_model.eval()
        self.config = config
        self.attn_backend = backend
        self.kv_cache = None
        hooks = {
            "init_forward_metadata": "init_forward_metadata",
            "init_forward_metadata_capture": "init_forward_metadata_capture_cuda_graph",
            "init_forward_metadata_replay": "init_forward_metadata_replay_cuda_graph",
            "cleanup_cuda_graph_state": "cleanup_cuda_graph_state",
        }
        for hook, method in hooks.items():
            setattr(self, hook, getattr(backend, method) if backend.plans else None)
        self.replans_prefill_graphs = backend.replans_prefill_graphs
        hf_model.set_attn_implementation(ATTN_IMPLEMENTATION)
        layers = list(hf_model.model.layers)
        # The last layer of each window size frees the decode metadata the first one of
        # that size made (the reference attention shares it per window size).
        windows = [self._window(layer.self_attn) for layer in layers]
        last_of = {w: i for i, w in enumerate(windows)}
        for i, layer in enumerate(layers):
            object.__setattr__(layer.self_attn, "_cgr_paged", _PagedBinding(self, i, last_of[windows[i]] == i))
        ref = next(hf_model.parameters())
        self.dtype, self.device = ref.dtype, ref.device

    @staticmethod
    def _window(attn: nn.Module) -> int:
        w = getattr(attn, "sliding_window", None)
        if w is None and getattr(attn.config, "model_type", "") == "mistral":
            w = getattr(attn.config, "sliding_window", None)
        return int(w or 0)

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_config(
        cls,
        config: Any,
        *,
        dtype: torch.dtype = torch.float32,
        device: Union[str, torch.device] = "cpu",
        seed: int = 0,
        std: Optional[float] = None,
        attention: Optional[str] = None,
    ) -> "HFCausalLM":
        """Random weights for transformers ``config`` (or an architecture name of
        :data:`SUPPORTED_ARCHITECTURES`: :func:`builtin_config`), seeded by ``seed``.

        Args:
            std: None keeps transformers' own initialisation (normal with the config's
                ``initializer_range``, norms 1); a float redraws every weight from
                normal(0, ``std``) and every norm from ``1 + normal(0, 0.2)``, so that a
                tiny model's greedy tokens have clear margins (tests, the CPU bench).

        Raises:
            UnsupportedHFModelError: see :func:`check_supported`.
        """
        transformers = _transformers()
        if isinstance(config, str):
            config = builtin_config(config)
        check_supported(config)
        torch.manual_seed(seed)
        # Built where it runs: initialising a 1B model on the host takes minutes on a few cores.
        with torch.device(device):
            hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        if std is not None:
            # Drawn on the host, so a seed gives the same weights on every device.
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for name, p in hf.named_parameters():
                    noise = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
                    p.copy_(1 + 0.2 * noise if "norm" in name else std * noise)
        return cls(hf.to(device), attention=attention)

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        dtype: torch.dtype = torch.float32,
        device: Union[str, torch.device] = "cpu",
        attention: Optional[str] = None,
        **kwargs: Any,
    ) -> "HFCausalLM":
        """A checkpoint folder (``config.json`` + safetensors) through transformers'
        ``AutoModelForCausalLM.from_pretrained``; ``kwargs`` go to it (``gguf_file=``).

        Raises:
            FileNotFoundError: ``path`` is not a folder with a ``config.json``.
            UnsupportedHFModelError: see :func:`check_supported` (before weights load).
        """
        transformers = _transformers()
        if not os.path.isfile(os.path.join(path, "config.json")) and "gguf_file" not in kwargs:
            raise FileNotFoundError(f"{path!r} is not a Hugging Face checkpoint folder (no config.json)")
        if "gguf_file" not in kwargs:
            check_supported(transformers.AutoConfig.from_pretrained(path))
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
        return cls(hf.to(device), attention=attention)

    # -- KV cache ----------------------------------------------------------------------

    def create_kv_cache(self, num_slots: int, max_reqs: int, max_context_len: int) -> PagedKVCache:
        """Create and attach a :class:`PagedKVCache` shaped for the model (layers, KV
        heads, head_dim; its dtype and device).

        Raises:
            ValueError: a size is too small (see :class:`PagedKVCache`).
        """
        c = self.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        self.kv_cache = PagedKVCache(
            c.num_hidden_layers,
            kv_heads,
            head_dim,
            num_slots,
            max_reqs,
            max_context_len,
            dtype=self.dtype,
            device=self.device,
        )
        return self.kv_cache

    # -- protocol ----------------------------------------------------------------------

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """``seq_lens`` of padded requests in decode graphs: the attention backend's."""
        return self.attn_backend.get_cuda_graph_seq_len_fill_value()

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """transformers' decoder on ``batch``, packed as one ``[1, num_tokens]`` row;
        writes this step's K/V into ``self.kv_cache``. Must run inside
        ``forward_context(batch)``.

        Returns:
            ``[num_tokens, hidden_size]`` hidden states after the final norm, model dtype.

        Raises:
            RuntimeError: no KV cache is attached.
        """
        if self.kv_cache is None:
            raise RuntimeError("no KV cache: call model.create_kv_cache(num_slots, max_reqs, max_context_len) first")
        out = self.hf_model.model(
            input_ids=batch.input_ids[None],
            position_ids=batch.positions[None],
            attention_mask=None,
            use_cache=False,
            forward_batch=batch,
            paged_kv_cache=self.kv_cache,
        )
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """transformers' LM head on ``hidden``, in float32.

        Returns:
            DECODE / TARGET_VERIFY / DLLM_EXTEND: ``[num_tokens, vocab_size]``.
            EXTEND: ``[batch_size, vocab_size]``, each request's last new token (zeros
            for a request of no new tokens: :func:`~cuda_graph_runner.backend.forward_batch.last_token_rows`).
        """
        if batch.forward_mode == ForwardMode.EXTEND:
            assert batch.extend_seq_lens is not None  # EXTEND batches carry it
            hidden = last_token_rows(hidden, batch.extend_seq_lens)
        return self.hf_model.lm_head(hidden).float()


def load_hf_model(
    spec: str,
    *,
    dtype: torch.dtype,
    device: Union[str, torch.device],
    attention: Optional[str] = None,
) -> HFCausalLM:
    """``bench --model hf:<arch>`` (random weights of :func:`builtin_config`: tiny on the
    CPU, with weights drawn wide enough for clear greedy margins; the llama-3.2-1b shape
    with transformers' own initialisation elsewhere), ``hf:<real model>`` (a name of
    :data:`cuda_graph_runner.reference.real_model.REAL_MODELS`, e.g. ``smollm2-135m``: its prepared
    checkpoint through transformers' own ``LlamaForCausalLM``) or ``hf:<folder>`` (a checkpoint).

    Raises:
        UnsupportedHFModelError: none of these, or a refused model.
        TransformersUnavailableError: transformers is not installed.
        RealModelUnavailableError: a real model whose packages are not installed.
    """
    from .. import real_model

    _transformers()
    name = spec[len("hf:") :] if spec.startswith("hf:") else spec
    device = torch.device(device)
    if name in real_model.REAL_MODELS:
        name = real_model.prepare(name)
    if name in SUPPORTED_ARCHITECTURES:
        tiny = device.type == "cpu"
        config = builtin_config(name, size="tiny" if tiny else "llama-3.2-1b")
        return HFCausalLM.from_config(
            config, dtype=dtype, device=device, std=0.15 if tiny else None, attention=attention
        )
    if os.path.isdir(name):
        return HFCausalLM.from_pretrained(name, dtype=dtype, device=device, attention=attention)
    raise UnsupportedHFModelError(
        f"--model {spec!r}: after 'hf:' give an architecture ({', '.join(SUPPORTED_ARCHITECTURES)}), "
        f"a real model ({', '.join(sorted(real_model.REAL_MODELS))}) or a checkpoint folder"
    )


def eager_reference(adapter: HFCausalLM, attn_implementation: str = "eager") -> nn.Module:
    """An independent transformers model with ``adapter``'s config and weights on
    transformers' own ``attn_implementation`` attention (``eager``: HF's own forward, to
    check the adapter against; ``sdpa``: what an HF user runs, for comparisons)."""
    transformers = _transformers()
    config = adapter.config.__class__.from_dict(adapter.config.to_dict())
    config._attn_implementation = attn_implementation
    with torch.device(adapter.device):
        reference = transformers.AutoModelForCausalLM.from_config(config, dtype=adapter.dtype)
    reference.load_state_dict(adapter.hf_model.state_dict())
    return reference.eval()


def reference_logits_fn(reference: nn.Module) -> Callable[[List[int]], torch.Tensor]:
    """``tokens -> [len(tokens), vocab]`` float32 logits of transformers' own forward of
    one sequence (no cache, no padding)."""

    def run(tokens: List[int]) -> torch.Tensor:
        device = next(reference.parameters()).device
        with torch.no_grad():
            return reference(input_ids=torch.tensor([tokens], device=device)).logits[0].float()

    return run
