"""``DraftDecodeCudaGraphRunner``: a standalone draft model's ``k`` greedy decode steps
for a batch, recorded in one graph per batch size (speculative decoding's draft side).

Inside the graph, step ``j`` feeds step ``j - 1``'s argmax back as its input token and
advances ``positions`` and ``seq_lens`` by one, all on the device: one replay proposes
``k`` tokens per request with no host round trip between steps. The runner is a
:class:`~.decode.DecodeCudaGraphRunner` (the shared decode base: sizes, padding, static
buffers, backends, variants); only ``out_cache_loc`` is wider (``k`` KV slots per request,
one per step) and the forward loops. The draft model has its own KV cache and the runner
its own static buffers.

Ideas from sglang's EAGLE draft CUDA-graph runner (``eagle_draft_cuda_graph_runner.py``:
the ``k`` draft steps of a batch in one graph, ``out_cache_loc`` of ``bs * k`` slots
assigned before the replay) and vLLM's drafter, which captures FULL graphs for its
proposer. Scope: a standalone draft model fed token ids. EAGLE / MTP drafts, which also
take the target's hidden states, are out of scope.

The draft's catch-up of tokens the target accepted that the draft never wrote (the
draft-extend step) is a plain one-token decode of the draft model, run by a
:class:`~.decode.DecodeCudaGraphRunner` of the draft model (see
:mod:`cuda_graph_runner.reference.speculative`).
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar, List, Optional, Tuple

import torch

from ..backend.base import ShapeKey
from ..backend.context import forward_context
from ..backend.forward_batch import ForwardBatch, ForwardMode
from ..backend.graph_break import refuse_breaks
from ..config import ConfigInput
from .decode import DecodeCudaGraphRunner
from .model_protocol import GraphModel
from .variants import compose_key_variant


def _num_steps(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"num_steps={value!r} is invalid: the draft runner takes an int >= 1 (tokens proposed per request)"
        )
    return value


class DraftDecodeCudaGraphRunner(DecodeCudaGraphRunner):
    """The draft model's ``num_steps`` greedy decode steps per replay; one graph per batch size.

    Args (beyond :class:`BaseCudaGraphRunner`'s):
        num_steps: ``k``, the tokens proposed per request (an int >= 1).

    Live batch (:func:`cuda_graph_runner.reference.speculative.make_draft_batch` builds one):
    a DECODE batch of ``bs`` requests whose fields describe step 0, except
    ``out_cache_loc``:

    * ``input_ids`` ``[bs]`` int64: each request's last committed token;
    * ``positions`` ``[bs]`` int64: its position (the draft's KV length before the step);
    * ``out_cache_loc`` ``[bs * k]`` int64, request-major: the KV slot of every step, each
      already assigned to its request's row of the draft cache's request-to-token table
      (step ``j`` of request ``i`` attends to positions ``0 .. positions[i] + j``);
    * ``req_pool_indices`` ``[bs]`` int64; ``seq_lens`` ``[bs]`` int32: KV length after
      step 0 (``positions + 1``); ``seq_lens_cpu`` its host copy.

    Keys read ``"draft:<k>"`` (``"draft:<k>|<variant>"`` with variants).

    Output: ``[bs, k]`` int64, the proposed tokens (the argmax of each step's float32
    logits). Replayed outputs live in graph memory until the next replay unless
    ``owned_outputs=True``.

    A marked op that a backend would run eagerly between graph segments (``breakable``'s
    ops that are not capture-safe for decode) is refused in steps after the first, since
    at replay it would see step 0's batch (:func:`~cuda_graph_runner.backend.graph_break.refuse_breaks`).
    Attention that plans on the host per batch (``init_forward_metadata_replay``) plans
    step 0 only, so such a model is refused for ``k > 1``.

    Raises:
        ValueError: ``num_steps`` is not an int >= 1; ``mode`` or ``num_tokens_per_req``
            given (the draft runner runs DECODE, one input token per request); a model
            with host-planned replay metadata and ``num_steps > 1``.
    """

    phase: ClassVar[str] = "decode"

    def __init__(self, model: GraphModel, config: ConfigInput = None, *, num_steps: int, **kwargs: Any) -> None:
        self.num_steps = _num_steps(num_steps)
        for name in ("mode", "num_tokens_per_req"):
            if name in kwargs:
                raise ValueError(
                    f"DraftDecodeCudaGraphRunner takes no {name}={kwargs[name]!r}: it runs DECODE, one input token per request"
                )
        if self.num_steps > 1 and getattr(model, "init_forward_metadata_replay", None) is not None:
            raise ValueError(
                f"{type(model).__name__} plans attention on the host before each replay (init_forward_metadata_replay); "
                f"a draft graph of num_steps={self.num_steps} would replay steps 1.. with step 0's plan. "
                "Use an attention whose decode metadata lives on the device, or num_steps=1"
            )
        super().__init__(model, config, mode=ForwardMode.DECODE, num_tokens_per_req=1, **kwargs)

    def make_key(self, size: int, variant: str = "") -> ShapeKey:
        """``ShapeKey(size, "draft:<k>[|<variant>]")``: told apart from a plain decode
        graph of the same model in tables, logs and traces."""
        return ShapeKey(size, compose_key_variant(f"draft:{self.num_steps}", variant))

    def slot_width(self, name: str) -> int:
        return self.num_steps if name == "out_cache_loc" else super().slot_width(name)

    def replay_prepare(self, batch: ForwardBatch) -> Any:
        check_draft_slots(batch, self.num_steps)
        return super().replay_prepare(batch)

    def graph_forward(self, batch: ForwardBatch) -> Any:
        return draft_steps(self.model, batch, self.num_steps)

    def output_rows(self, size: int) -> Tuple[int, Optional[int]]:
        # [bs, k] tokens: one row per request (width 1, so tokens and requests agree).
        return size, size

    def eager_forward(self, batch: ForwardBatch) -> Any:
        return draft_steps(self.model, batch, self.num_steps)


def check_draft_slots(batch: ForwardBatch, num_steps: int) -> int:
    """The batch size of a draft batch, after checking its ``out_cache_loc`` holds one KV
    slot per request and step.

    Raises:
        ValueError: another number of slots (names both counts).
    """
    bs = int(batch.req_pool_indices.shape[0])
    if batch.out_cache_loc.shape[0] != bs * num_steps:
        raise ValueError(
            f"draft batch: out_cache_loc has {batch.out_cache_loc.shape[0]} slots for {bs} requests; "
            f"num_steps={num_steps} takes {bs * num_steps} (one KV slot per request and step, "
            "request-major: reference.speculative.make_draft_batch)"
        )
    return bs


_STEP_BREAK = (
    "a draft graph's steps after the first replay eager ops with step 0's batch; "
    "declare the op capture-safe for decode, use a backend that records it (full), or num_steps=1"
)


def draft_steps(model: GraphModel, batch: ForwardBatch, num_steps: int) -> torch.Tensor:
    """``num_steps`` greedy decode steps of ``model`` from ``batch`` (the draft runner's
    layout, see :class:`DraftDecodeCudaGraphRunner`), capture-safe: every step's inputs
    are device tensors computed from the previous step (no host reads).

    Returns:
        ``[bs, num_steps]`` int64 proposed tokens.

    Raises:
        ValueError: ``out_cache_loc`` does not hold ``bs * num_steps`` slots.
    """
    bs = check_draft_slots(batch, num_steps)
    locs = batch.out_cache_loc.view(bs, num_steps)
    ids, positions, seq_lens = batch.input_ids, batch.positions, batch.seq_lens
    tokens: List[torch.Tensor] = []
    for j in range(num_steps):
        # Steps past the first carry no host lengths: a graph must not read the host
        # (the guard refuses it during capture); only step 0's are the batch's own.
        changes = {} if j == 0 else {"seq_lens_cpu": None}
        step = batch.replace(
            input_ids=ids, positions=positions, out_cache_loc=locs[:, j].contiguous(), seq_lens=seq_lens, **changes
        )
        with forward_context(step), refuse_breaks(_STEP_BREAK) if j else contextlib.nullcontext():
            logits = model.compute_logits(model.forward(step), step)
        ids = logits[:bs].argmax(dim=-1)
        tokens.append(ids)
        if j + 1 < num_steps:
            positions = positions + 1
            seq_lens = seq_lens + 1
    return torch.stack(tokens, dim=1)
