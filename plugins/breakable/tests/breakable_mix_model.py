"""The two-marked-op model of the breakable tests, shared by the CPU and the GPU files.

Each file passes its own marked ops (a CPU one and a device one, registered under names
of their own), so the model and its logits stay one definition.
"""

from __future__ import annotations

from typing import Callable, List

import torch

from cuda_graph_runner.backend import ForwardBatch, ForwardMode

MixOp = Callable[[torch.Tensor, torch.Tensor, float], None]
ScaleOp = Callable[[torch.Tensor], torch.Tensor]


def request_lens(batch: ForwardBatch) -> List[int]:
    """The live requests' token counts (host values): EXTEND lengths, else the fixed width."""
    if batch.forward_mode is ForwardMode.EXTEND:
        return list(batch.extend_seq_lens_cpu)
    return [batch.num_tokens_per_req] * batch.batch_size


class MixModel(torch.nn.Module):
    """Two calls of the marked op ``mix`` per forward, token-axis inputs only inside the graph.

    ``forward(batch)`` gives ``[num_tokens, hidden]``; ``compute_logits`` gives float32
    ``[bs, vocab]`` in EXTEND (each request's last token) and ``[num_tokens, vocab]``
    otherwise.

    Args:
        mix: ``mix(out, x, scale)`` writes per-request results into ``out`` (a marked op).
        scaled: a marked op returning a fresh tensor, used when ``returning``.
        head_scale: multiplies the random head (smaller logits on the device).
        slot_term: add ``0.001 * out_cache_loc`` to the embedding (the KV slot reaches the graph).
        side_stream: fork a CUDA side stream that overlaps the first ``mix`` and join it after.
    """

    def __init__(
        self,
        mix: MixOp,
        scaled: ScaleOp,
        *,
        vocab: int,
        hidden: int,
        head_scale: float = 1.0,
        slot_term: bool = False,
        returning: bool = False,
        side_stream: bool = False,
    ) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g), requires_grad=False)
        self.head = torch.nn.Parameter(torch.randn(hidden, vocab, generator=g) * head_scale, requires_grad=False)
        self.mix, self.scaled = mix, scaled
        self.slot_term, self.returning = slot_term, returning
        self.side = torch.cuda.Stream() if side_stream else None

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h = self.embed[batch.input_ids] + 0.01 * batch.positions[:, None].float()
        if self.slot_term:
            h = h + 0.001 * batch.out_cache_loc[:, None].float()
        y = None
        if self.side is not None:
            self.side.wait_stream(torch.cuda.current_stream())  # fork: overlaps the marked op below
            with torch.cuda.stream(self.side):
                y = torch.sin(h) * 3 + 1
        out = torch.empty_like(h)
        self.mix(out, h, 0.5)
        if self.side is not None:
            torch.cuda.current_stream().wait_stream(self.side)  # join after the op
            out = out + y
        h = torch.tanh(out) + h
        if self.returning:
            h = self.scaled(h) + 1
        out2 = torch.empty_like(h)
        self.mix(out2, h, 0.25)
        return out2 * 2 - h

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if batch.forward_mode is ForwardMode.EXTEND:
            hidden = hidden[torch.cumsum(batch.extend_seq_lens.long(), 0) - 1]
        return (hidden @ self.head).float()
