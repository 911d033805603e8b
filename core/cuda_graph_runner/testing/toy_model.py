"""A tiny model honouring the runner's model protocol, for CPU runner and backend tests.

Its output depends on every static input (token ids, positions, KV slot, request row,
sequence length), so a padding or copy mistake in a runner changes the numbers.
"""

from __future__ import annotations

import torch

from cuda_graph_runner.backend.forward_batch import ForwardBatch, ForwardMode


class ToyModel(torch.nn.Module):
    """Embedding plus a scalar of the batch's static inputs, then a linear head.

    ``forward(batch)`` returns ``[num_tokens, hidden]`` float32; ``compute_logits`` gives
    ``[num_tokens, vocab]`` float32 (every token, EXTEND included). No KV cache: token ids
    must be below ``vocab``. ``post_warmup_calls`` counts :meth:`post_warmup_hook` calls.
    """

    def __init__(self, vocab: int = 16, hidden: int = 8) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g))
        self.head = torch.nn.Parameter(torch.randn(hidden, vocab, generator=g))
        self.post_warmup_calls = 0

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h = self.embed[batch.input_ids]
        width = batch.num_tokens_per_req if batch.forward_mode.is_decode_like() else 1
        per_token = torch.stack([batch.req_pool_indices, batch.seq_lens.long()], dim=1).repeat_interleave(width, 0)
        if batch.forward_mode is ForwardMode.EXTEND:
            per_token = torch.zeros(batch.num_tokens, 2, dtype=torch.long, device=h.device)
        extra = torch.stack([batch.positions, batch.out_cache_loc], dim=1)
        return h + 0.01 * torch.cat([per_token, extra], dim=1).float().sum(dim=1, keepdim=True)

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return (hidden @ self.head).float()

    def post_warmup_hook(self) -> None:
        self.post_warmup_calls += 1


def decode_batch(bs: int, *, width: int = 1, offset: int = 1) -> ForwardBatch:
    """A live batch with distinct non-zero values everywhere (rows >= 1)."""
    tokens = bs * width
    mode = ForwardMode.DECODE if width == 1 else ForwardMode.TARGET_VERIFY
    seq = torch.arange(bs, dtype=torch.int32) + 5 + width
    return ForwardBatch(
        forward_mode=mode,
        input_ids=(torch.arange(tokens) * 3 + offset) % 16,
        positions=torch.arange(tokens) + 4,
        out_cache_loc=torch.arange(tokens) + 10,
        req_pool_indices=torch.arange(bs) + 1,
        seq_lens=seq,
        seq_lens_cpu=seq.tolist(),
        num_tokens_per_req=width,
    )
