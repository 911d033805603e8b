"""Shared cases of Hugging Face adapter tests (the core's and a plugin's): a tiny
random-weight transformers model with its adapter, ragged prompts, transformers' own greedy
``generate()`` and a continuous batch through a runner's prefill and decode. Needs the
optional transformers (``pip install 'cuda-graph-runner[transformers]'``): callers skip
without it first (``pytest.importorskip("transformers", reason=...)``)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..reference.batches import make_decode_batch, make_extend_batch
from ..reference.models.hf import HFCausalLM, builtin_config, eager_reference

#: greedy tokens generated per prompt
STEPS = 32
PROMPT_LENS = (7, 3, 12, 1, 9)
ADMIT_AT = (0, 0, 2, 5, 9)  # decode step at which each prompt joins the running batch

#: ``batch -> float32 logits [rows, vocab]`` (a runner's ``forward``, or the eager one)
Forward = Callable[[Any], torch.Tensor]


def tiny_models(arch: str, seed: int = 0, attention: Optional[str] = None, **overrides: Any) -> Tuple[HFCausalLM, Any]:
    """(adapter, reference): the float32 CPU adapter of ``arch``'s tiny built-in config
    (with ``overrides`` of its keys; weights normal(0, 0.15), so greedy tokens have clear
    margins; ``attention`` its attention backend, default ``torch``) and an eager
    transformers model (a ``PreTrainedModel``) with the same weights."""
    config = builtin_config(arch)
    for key, value in overrides.items():
        setattr(config, key, value)
    if overrides.get("use_sliding_window"):  # Qwen2's per-layer windows follow from these keys
        config = config.__class__(**{**config.to_dict(), "layer_types": None})
    adapter = HFCausalLM.from_config(config, seed=seed, std=0.15, attention=attention)
    return adapter, eager_reference(adapter)


def ragged_prompts(vocab: int) -> List[List[int]]:
    """One prompt of each of :data:`PROMPT_LENS` tokens, ids in ``[0, vocab)``, seeded."""
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def hf_generate(reference: Any, prompt: List[int]) -> List[int]:
    """transformers' eager greedy ``generate()`` of ``prompt`` alone: :data:`STEPS` tokens
    (no end-of-sequence stop, and no processor that would mask the EOS logit)."""
    reference.generation_config.eos_token_id = None
    device = next(reference.parameters()).device
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            max_new_tokens=STEPS,
            do_sample=False,
            pad_token_id=0,
        )
    assert out.shape[1] == len(prompt) + STEPS
    return out[0, len(prompt) :].tolist()


def run_continuous_batch(
    adapter: HFCausalLM, prompts: List[List[int]], prefill: Forward, decode: Forward
) -> List[List[int]]:
    """Greedy :data:`STEPS` tokens per prompt (``[len(prompts)][STEPS]`` ids); prompt ``i``
    joins the running batch at decode step ``ADMIT_AT[i]`` and leaves it (its cache row
    freed) when done."""
    cache = adapter.kv_cache
    assert cache is not None, "call adapter.create_kv_cache first"
    tokens: Dict[int, List[int]] = {}
    rows: Dict[int, int] = {}
    step = 0
    with torch.no_grad():
        while len(tokens) < len(prompts) or any(len(t) < STEPS for t in tokens.values()):
            joining = [i for i, at in enumerate(ADMIT_AT) if at == step]
            if joining:
                batch = make_extend_batch(cache, [prompts[i] for i in joining])
                rows.update({i: int(r) for i, r in zip(joining, batch.req_pool_indices.tolist())})
                logits = prefill(batch)[: len(joining)]
                for i, t in zip(joining, logits.argmax(-1).tolist()):
                    tokens[i] = [t]
            live = [i for i in sorted(tokens) if len(tokens[i]) < STEPS]
            if live:
                batch = make_decode_batch(cache, [rows[i] for i in live], None, [tokens[i][-1] for i in live])
                logits = decode(batch)[: len(live)]
                for i, t in zip(live, logits.argmax(-1).tolist()):
                    tokens[i].append(t)
            for i in [i for i in live if len(tokens[i]) == STEPS]:
                cache.free_request(rows[i])
            step += 1
    return [tokens[i] for i in range(len(prompts))]
