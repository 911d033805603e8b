"""The reference model with the classic host-value bug, for the guard and verify-mode tests.

Its forward scales the hidden states by 2.0 when ``max(batch.seq_lens_cpu) > 8`` and by
1.0 otherwise (after the final norm, so the logits double). Captured into a graph, the
branch of the capture's dummy lengths is frozen: every replay takes it, whatever the
live lengths (Hugging Face ``LlamaForCausalLM``'s mask code fails the same way).
"""

from __future__ import annotations

import torch

from cuda_graph_runner.backend.forward_batch import ForwardBatch
from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM

THRESHOLD = 8


class HostBranchLlama(ReferenceLlamaForCausalLM):
    """``ReferenceLlamaForCausalLM`` whose output depends on a host value of the batch."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = super().forward(batch)
        scale = 2.0 if max(batch.seq_lens_cpu) > THRESHOLD else 1.0
        return hidden * scale


def make_model(
    cls=HostBranchLlama, *, device: str = "cpu", dtype: torch.dtype = torch.float32, context: int = 48
) -> ReferenceLlamaForCausalLM:
    model = cls.from_preset("tiny", dtype=dtype, device=device)
    model.create_kv_cache(num_slots=2048, max_reqs=32, max_context_len=context)
    return model
