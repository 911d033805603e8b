"""A reference Llama-family decoder (Llama, Qwen2, Mistral) over a paged KV cache.

The model the runners and backends are tested with. It follows Hugging Face
transformers' numerics (RMSNorm in float32, RoPE tables in float32, logits in float32)
so it can be checked against ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` /
``MistralForCausalLM`` on the same checkpoint, and sglang's layout (fused ``qkv_proj``
and ``gate_up_proj``, a token-major batch without a batch axis).

Model protocol used by the runners:

* ``forward(batch) -> [num_tokens, hidden]`` hidden states after the final norm; must
  run inside :func:`~cuda_graph_runner.backend.context.forward_context`.
* ``compute_logits(hidden, batch) -> float32 logits``.
* the metadata hooks (``init_forward_metadata``, ``init_forward_metadata_capture``,
  ``init_forward_metadata_replay``, ``cleanup_cuda_graph_state``) forwarded to the
  model's attention backend (:mod:`.attention_backend`, chosen by name when the model is
  built); None for ``torch``, whose attention reads live metadata from the forward context.

KV cache ownership: the model holds at most one :class:`PagedKVCache` in
``model.kv_cache``; create it with :meth:`ReferenceLlamaForCausalLM.create_kv_cache`
(or attach one with :meth:`~ReferenceLlamaForCausalLM.attach_kv_cache`).

Each layer writes this step's K/V into the cache (``k_cache[out_cache_loc] = k``) and
then calls its attention backend (``torch``: the marked eager op
``cuda_graph_runner::reference_llama_attention``).

A step is idempotent: running the same batch twice writes the same values into the same
slots and returns the same output, which verify mode (:mod:`cuda_graph_runner.runner.verify`)
relies on when it re-runs a replayed step eagerly. Inside the captured forward the model
reads only device tensors of the batch; host lengths are read inside the marked
attention op only (EXTEND), so the host-value guard (:mod:`cuda_graph_runner.backend.host_guard`)
never trips on it.

Modules: :mod:`.config` (shapes, presets, Hugging Face ``config.json`` parsing),
:mod:`.rope` (rotary tables), :mod:`.attention` (the marked paged-attention op),
:mod:`.attention_backend` (the attention-backend interface, ``torch``),
:mod:`.planned_standin` (a CPU stand-in of a plan-based attention),
:mod:`.layers` (linear, norm, attention and MLP blocks), :mod:`.loading` (safetensors
checkpoints), :mod:`.lora` (LoRA adapters served per request), :mod:`.causal_lm` (the model).
"""

from .attention import reference_llama_attention
from .attention_backend import (
    ATTENTION_BACKENDS,
    DEFAULT_ATTENTION,
    AttentionBackend,
    TorchAttention,
    attention_backend_names,
    make_attention_backend,
)
from .causal_lm import ReferenceLlamaForCausalLM
from .config import PRESETS, SUPPORTED_MODEL_TYPES, SUPPORTED_ROPE_TYPES, ModelConfig
from .lora import LORA_IDS, LoRAAdapters
from .rope import compute_inv_freq  # noqa: F401 - exported, outside __all__

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "DEFAULT_ATTENTION",
    "TorchAttention",
    "attention_backend_names",
    "make_attention_backend",
    "LORA_IDS",
    "LoRAAdapters",
    "ModelConfig",
    "PRESETS",
    "SUPPORTED_MODEL_TYPES",
    "SUPPORTED_ROPE_TYPES",
    "ReferenceLlamaForCausalLM",
    "reference_llama_attention",
]
