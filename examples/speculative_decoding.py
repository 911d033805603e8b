"""Speculative decoding on the runners, engine side: a target verify graph, a draft model's
k-step graph and its draft-extend graph, driven by the reference loop; the tokens are
checked against plain greedy decoding.

    python examples/speculative_decoding.py --device cuda --k 4
    python examples/speculative_decoding.py --device cpu --backend disabled   # eager runners

On the CPU the graph backends need a CUDA device; ``disabled`` runs the same runners
eagerly (the API and the loop, no graphs). See docs/speculative.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

import torch

from cuda_graph_runner.config import CudaGraphConfig
from cuda_graph_runner.reference.batches import greedy_generate, make_dummy_prompts
from cuda_graph_runner.reference.speculative import ModelDraft, SpeculativeStats, layer_skip_draft, speculative_generate
from cuda_graph_runner.runner import DecodeCudaGraphRunner, DraftDecodeCudaGraphRunner
from cuda_graph_runner.testing.reference_setup import reference_model, staggered_lengths


def run(device: str, backend: str, k: int, requests: int, draft_layers: int) -> "tuple[bool, SpeculativeStats]":
    """Generate for ``requests`` ragged prompts with speculation and without; returns
    whether the tokens agree, and the loop's counts."""
    budgets = [4 + 5 * i for i in range(requests)]  # requests finish at different rounds
    context = 8 + max(budgets) + k + 1
    target = reference_model("tiny", requests=requests, context=context, device=device)
    draft_model = layer_skip_draft(target, draft_layers, requests=requests, context=context)
    config = CudaGraphConfig.from_dict({"decode": {"backend": backend, "max_bs": requests}})
    verify = DecodeCudaGraphRunner(target, config, mode="target_verify", num_tokens_per_req=k + 1, show_progress=False)
    draft_runner = DraftDecodeCudaGraphRunner(draft_model, config, num_steps=k, show_progress=False)
    extend = DecodeCudaGraphRunner(draft_model, config, show_progress=False)
    for runner in (verify, draft_runner, extend):
        runner.capture()
    prompts = make_dummy_prompts(requests, staggered_lengths(requests), target.config.vocab_size, seed=0)
    stats = SpeculativeStats()
    draft = ModelDraft(draft_model, draft_fn=draft_runner.forward, extend_fn=extend.forward, read_between_proposes=True)
    got = speculative_generate(target, prompts, budgets, draft, k, verify_fn=verify.forward, stats=stats)
    plain = greedy_generate(target, target.kv_cache, prompts, max(budgets))
    return got == [p[:b] for p, b in zip(plain, budgets)], stats


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="speculative decoding on the runners")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="full" if torch.cuda.is_available() else "disabled")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--draft-layers", type=int, default=1)
    args = parser.parse_args(argv)
    same, stats = run(args.device, args.backend, args.k, args.requests, args.draft_layers)
    print(
        f"rounds {stats.rounds}, accept rate {stats.accept_rate:.2f}, {stats.tokens_per_round:.2f} tokens per round; "
        + ("tokens equal plain greedy decoding" if same else "TOKENS DIFFER from plain greedy decoding")
    )
    return 0 if same else 1


if __name__ == "__main__":
    from cuda_graph_runner.backend.errors import BackendUnavailableError, UnknownBackendError

    try:
        raise SystemExit(main())
    except (UnknownBackendError, BackendUnavailableError, ValueError) as exc:
        # A user's mistake (a backend name, one this device cannot run, a bad value): one line, exit 2.
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2) from None
