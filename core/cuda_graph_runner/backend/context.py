"""The live batch, reachable from code that cannot take it as an argument.

Marked eager ops (``graph_break``) are torch custom ops whose arguments are tensors
and scalars only; they read per-request metadata of the batch being run (host-side
lengths, for example) from here. The runner sets it around every eager forward,
capture and replay, so a marked op replayed between graph pieces sees the *live*
batch, not the one it was captured with (vLLM's ``forward_context``, sglang's
replay ``ForwardBatch`` view).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Dict, Iterator, Optional, Tuple

from .forward_batch import ForwardBatch

_current: contextvars.ContextVar[Optional[Tuple[ForwardBatch, Dict[str, Any]]]] = contextvars.ContextVar(
    "cuda_graph_runner_forward_batch", default=None
)

_NO_BATCH = "no forward batch is set: wrap the model call in cuda_graph_runner.backend.context.forward_context(batch)"


@contextlib.contextmanager
def forward_context(batch: ForwardBatch) -> Iterator[ForwardBatch]:
    """Make ``batch`` the current batch for the duration of the block (re-entrant).

    Each block also gets a fresh scratch dict (:func:`forward_scratch`): one block is one
    forward (runners open one per eager run, warm-up, capture and replay).
    """
    token = _current.set((batch, {}))
    try:
        yield batch
    finally:
        _current.reset(token)


def get_forward_batch() -> ForwardBatch:
    """The batch being run now.

    Raises:
        RuntimeError: outside any ``forward_context`` (a marked op called outside a
            runner, usually a model driven without one).
    """
    current = _current.get()
    if current is None:
        raise RuntimeError(_NO_BATCH)
    return current[0]


def forward_scratch() -> Dict[str, Any]:
    """A dict private to the current forward, for per-batch metadata that every layer
    shares (computed by the first layer's op, reused by the others), like sglang's
    attention backends computing ``forward_metadata`` once per batch.

    It never outlives the ``forward_context`` block, so nothing computed from one batch
    is ever read by the next: replays cannot see stale metadata through it.

    Raises:
        RuntimeError: outside any ``forward_context``.
    """
    current = _current.get()
    if current is None:
        raise RuntimeError(_NO_BATCH)
    return current[1]
