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
from typing import Iterator, Optional

from .forward_batch import ForwardBatch

_current: contextvars.ContextVar[Optional[ForwardBatch]] = contextvars.ContextVar(
    "cuda_graph_runner_forward_batch", default=None
)


@contextlib.contextmanager
def forward_context(batch: ForwardBatch) -> Iterator[ForwardBatch]:
    """Make ``batch`` the current batch for the duration of the block (re-entrant)."""
    token = _current.set(batch)
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
    batch = _current.get()
    if batch is None:
        raise RuntimeError(
            "no forward batch is set: wrap the model call in "
            "cuda_graph_runner.forward_context.forward_context(batch)"
        )
    return batch
