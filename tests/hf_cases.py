"""Shared cases of the core's Hugging Face adapter tests (tests/test_hf_adapter*.py; a
plugin's tests keep their own, on cuda_graph_runner.testing.workload): tiny random-weight
models, ragged prompts, transformers' own greedy ``generate()`` and a continuous batch
through a runner's prefill and decode."""

from __future__ import annotations

import torch
import transformers  # noqa: F401  (callers skip without it first)

from cuda_graph_runner.reference.batches import make_decode_batch, make_extend_batch
from cuda_graph_runner.reference.models import hf

STEPS = 32
PROMPT_LENS = (7, 3, 12, 1, 9)
ADMIT_AT = (0, 0, 2, 5, 9)  # decode step at which each prompt joins the running batch


def tiny_models(arch: str, seed: int = 0, attention=None, **overrides):
    """(adapter, reference): the adapter of ``arch``'s tiny built-in config (with
    ``overrides`` of its keys) and an eager transformers model with the same weights."""
    config = hf.builtin_config(arch)
    for key, value in overrides.items():
        setattr(config, key, value)
    if overrides.get("use_sliding_window"):  # Qwen2's per-layer windows follow from these keys
        config = config.__class__(**{**config.to_dict(), "layer_types": None})
    adapter = hf.HFCausalLM.from_config(config, seed=seed, std=0.15, attention=attention)
    return adapter, hf.eager_reference(adapter)


def ragged_prompts(vocab: int):
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def hf_generate(reference, prompt):
    """transformers' eager greedy ``generate()`` of ``prompt`` alone: ``STEPS`` tokens
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


def run_continuous_batch(adapter, prompts, prefill, decode):
    """Greedy ``STEPS`` tokens per prompt; prompt ``i`` joins at decode step ``ADMIT_AT[i]``."""
    cache = adapter.kv_cache
    tokens = {}
    rows = {}
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
