"""Shape and numerics of a Llama-family decoder: :class:`ModelConfig`, the CPU and
checkpoint-sized :data:`PRESETS`, and parsing of a Hugging Face ``config.json``."""

import dataclasses
from typing import Any, Dict, Mapping, Optional

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


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
            raise ValueError(f"unsupported model_type {model_type!r}; accepted: {list(SUPPORTED_MODEL_TYPES)}")
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
            raise ValueError("qwen2 use_sliding_window=True is not supported (per-layer windows); accepted: false")

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
    "tiny-qwen2": ModelConfig(model_type="qwen2", tie_word_embeddings=True, qkv_bias=True, rope_theta=1e6),
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
