"""Loading a Hugging Face safetensors checkpoint (one file or an index of shards) into
the fused parameters of :class:`~cuda_graph_runner.reference.model.ReferenceLlamaForCausalLM`."""

import json
import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

import torch

from ..tensor_parallel import shard_hf_tensor
from .config import ModelConfig

if TYPE_CHECKING:  # the mixin's subclass; imported for the annotation only (no cycle at run time)
    from .causal_lm import ReferenceLlamaForCausalLM


class HFCheckpointMixin:
    """``from_pretrained`` and the Hugging Face name -> parameter map of the reference
    model; the class it is mixed into provides ``__init__(config, dtype=, device=)``,
    ``config``, ``model`` (the backbone) and ``lm_head``."""

    # Provided by the class this is mixed into (annotations only, for the type checker).
    config: Any
    model: Any
    lm_head: Any
    tp_layout: Any

    @classmethod
    @torch.no_grad()
    def from_pretrained(
        cls,
        path: Union[str, os.PathLike],
        *,
        dtype: torch.dtype = torch.float32,
        device: Union[str, torch.device] = "cpu",
        tp_group: Any = None,
        attention: Optional[str] = None,
    ) -> "ReferenceLlamaForCausalLM":
        """Load a Hugging Face checkpoint directory (``attention``: the attention backend's
        name, as the model class takes it).

        Reads ``config.json`` and either ``model.safetensors`` or the shards listed in
        ``model.safetensors.index.json``; q/k/v and gate/up weights are fused. A
        ``lm_head.weight`` of a tied model and ``rotary_emb.inv_freq`` are ignored.
        With ``tp_group`` each rank reads only its shard of every tensor
        (:func:`~cuda_graph_runner.reference.tensor_parallel.shard_hf_tensor`).

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

        model: Any = cls(config, dtype=dtype, device=device, tp_group=tp_group, attention=attention)  # type: ignore[call-arg]  # the class mixed into provides __init__
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
                    src = (
                        f.get_tensor(name)
                        if tp_group is None
                        else shard_hf_tensor(name, f.get_slice(name), model.tp_layout)
                    )
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
