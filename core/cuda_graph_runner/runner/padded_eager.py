"""Padded eager: an eager forward run at the size a replay would use, then cut back.

A replay pads a live batch up to the smallest captured size and runs the graph at that
shape; an eager forward runs the live shape. In float32 the live rows agree to
rounding; in bf16 they may not even agree on the top-1 token, because GEMM kernels (and
their reduction orders) are picked by shape: padding 13 requests to 16 changes which
kernel computes the 13 live rows. With the phase key ``padded_eager: true`` every eager
forward of the runner (backend ``disabled``, a fallback, verify mode's reference) of a
batch that a captured size covers builds the padded batch a replay would see (the same
pad values: request row 0, KV slot 0, token 0, position 0, ``seq_len_fill_value``),
runs the same forward the graph records (:meth:`graph_forward`) on it, and cuts the
outputs back with the replay's own :meth:`finish_output`. Replay and eager then run the
same shapes, so an engine with graphs and one without (or a trainer recomputing a
rollout's log-probs through the same runner) get bitwise-equal outputs, wherever the
model's eager and captured paths run the same kernels (the reference torch attention
does; an attention that plans other kernels for graphs, a FlashInfer wrapper with
``use_cuda_graph``, need not).

Cost: the padded rows' compute on every eager step (up to the next bucket: decode 13
requests run as 16, prefill 600 tokens as 640) and one allocation per padded field. A
batch larger than the largest captured size, empty, of another mode, beyond the graphs'
request slots (prefill ``full``), or (prefill) padded to more than twice its tokens runs as it is: no replay would take it either, so replay
and eager still run the same shapes.

Idea: batch-invariant kernels (vLLM's ``VLLM_BATCH_INVARIANT=1``, docs.vllm.ai "Batch
Invariance"; SGLang's ``--enable-deterministic-inference``) make a row's result independent
of the batch it is in, at a kernel cost on every step; padding the eager run needs no
kernel of its own, only that replay and eager run the same shapes, and costs only on eager
steps. It does not make a request's result independent of its batch mates' count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Mapping, Optional, Sequence

import torch

from ..backend.context import forward_context
from ..backend.forward_batch import ForwardBatch
from .static_inputs import StaticInput

if TYPE_CHECKING:
    from .base import BaseCudaGraphRunner

__all__ = ["padded_eager_size", "pad_rows", "pad_extra", "run_padded_eager"]


def padded_eager_size(runner: "BaseCudaGraphRunner", batch: ForwardBatch) -> Optional[int]:
    """The captured size ``batch`` pads to under ``padded_eager``, or None when it runs as
    it is: another mode or layout, beyond the runner's own limit (:meth:`fits_graphs`:
    prefill's request slots), empty, larger than the largest captured size, or padded
    beyond the runner's ``max_padding_ratio`` (prefill: more than twice its tokens), where
    a runner with graphs runs the live size too."""
    if not runner.batch_matches(batch) or not runner.fits_graphs(batch):
        return None
    size = runner.size_of(batch)
    if size <= 0 or size > runner.max_size:
        return None
    padded = runner.replay_target(size)[0]
    ratio = getattr(runner, "max_padding_ratio", None)
    if ratio is not None and padded > ratio * size:
        return None
    return padded


def pad_rows(t: torch.Tensor, rows: int, value: float) -> torch.Tensor:
    """``t`` ``[n, ...]`` grown to ``[rows, ...]`` with ``value`` in the new rows (``t``
    itself when it has them already)."""
    extra = rows - t.shape[0]
    if extra <= 0:
        return t
    return torch.cat([t, torch.full((extra, *t.shape[1:]), value, dtype=t.dtype, device=t.device)])


def pad_extra(
    extra: Mapping[str, Any],
    specs: Sequence[StaticInput],
    requests: int,
    padded_requests: int,
    tokens_per_req: int,
    device: torch.device,
) -> dict:
    """The live ``extra`` with every model-declared static input (:mod:`.static_inputs`)
    padded as a replay pads it: rows past the live ones, and an input the batch does not
    give, hold the input's ``pad_value``; host lists become tensors of its dtype. Other
    entries pass through by reference."""
    out = dict(extra)
    for spec in specs:
        per = tokens_per_req if spec.axis == "token" else 1
        rows, padded = requests * per, padded_requests * per
        value = extra.get(spec.name)
        if value is None:
            out[spec.name] = torch.full((padded, *spec.trailing_shape), spec.pad_value, dtype=spec.dtype, device=device)
            continue
        t = value if isinstance(value, torch.Tensor) else torch.tensor(list(value), dtype=spec.dtype)
        out[spec.name] = pad_rows(t.to(device=device, dtype=spec.dtype)[:rows], padded, spec.pad_value)
    return out


def pad_host(values: Optional[Sequence[int]], rows: int, fill: int) -> Optional[List[int]]:
    """A host list padded with ``fill`` to ``rows`` entries (None stays None)."""
    if values is None:
        return None
    values = list(values)
    return values + [fill] * (rows - len(values))


def run_padded_eager(runner: "BaseCudaGraphRunner", batch: ForwardBatch, padded: int) -> Any:
    """``runner``'s forward of ``batch`` padded to captured size ``padded``, eagerly, cut
    back to the live rows: ``runner.pad_batch``, the model's eager metadata hook
    ``init_forward_metadata`` on the padded batch, ``runner.graph_forward`` inside its
    forward context, then ``runner.finish_output`` (the replay's slicing; prefill's LM
    head on the live batch)."""
    static = runner.pad_batch(batch, padded)
    init = getattr(runner.model, "init_forward_metadata", None)
    if init is not None:
        init(static)
    with forward_context(static):
        output = runner.graph_forward(static)
    return runner.finish_output(output, batch, static, None)
