"""Marked-op bodies compiled per compile size (regional compilation) for compiled full.

A marked op (attention) is one opaque custom op to the compiled forward, so inductor
cannot fuse what runs inside it, and ``torch.compile(mode="reduce-overhead")`` runs it
as written too. At each compile size compiled full runs every marked op's Python body
through a ``torch.compile`` of its own (:func:`compiled_op_bodies`, installed with
:func:`cuda_graph_runner.backend.graph_break.marked_op_bodies`): the op stays opaque to the
forward's graph and to the capture, while the gathers, mask conversion and copies
around its attention kernel become a few Triton kernels (H200, llama-3.2-1b, 16 layers,
batch 32: the step 0.993x -> 0.924x reduce-overhead's; docs/benchmarks.md).

What each compiled body call keeps true:

* the host-value guard is armed as in ``full``'s capture (scope ``"forward"``, unless
  the config turned it off), also while Dynamo traces the body in the compile pass: the
  guard's checks are evaluated once at trace time and folded into the code, so a body
  that reads a host value raises
  :class:`~cuda_graph_runner.backend.errors.CudaGraphHostValueError` there rather than
  freezing the value into every replay;
* Dynamo's recompile limit covers every size: a body usually graph-breaks early (the
  forward context is a ``ContextVar``, which Dynamo does not trace), so the functions it
  calls are compiled as frames of their own, shared by all sizes, a few entries per size;
* nothing is recorded into Dynamo's package cache (torch cannot file a marked op's body
  under its module name, which holds the ``EagerOp``:
  :func:`cuda_graph_runner.backend.compile_cache_dynamo.precompile_paused`); inductor's caches
  still serve the bodies' code.

A body that must not be compiled opts out with ``torch.compiler.disable`` applied under
``@eager_op`` (``@eager_op(...)`` outermost). Bodies run only inside compiled full's
compile pass and captures (replays run no Python), one thread at a time: the settings
above are process-wide Dynamo config, patched per call.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Dict, Iterator, Sequence

import torch

from cuda_graph_runner.backend import (
    SCOPE_FORWARD,
    entry_function,
    host_value_guard,
    precompile_paused,
    registered_eager_ops,
)

#: Dynamo cache entries allowed per body frame and compile size (first, middle and last
#: layer's call of the reference attention make 3).
ENTRIES_PER_SIZE = 8


def compiled_op_bodies(
    sizes: Sequence[int],
    *,
    tag: str,
    phase: str,
    backend: Callable[..., Any],
    label: str = "full",
    guard_scope: str = SCOPE_FORWARD,
) -> Dict[int, Dict[str, Callable[..., Any]]]:
    """``{size: {op name: compiled body}}`` for every marked op registered now and every
    size of ``sizes``: a code object per op and size (``full_compiled_op_<name>_<tag>_<size>``),
    compiled by ``backend`` with static shapes at its first call. Ops registered later
    keep their own bodies. Only the ops the forward calls are ever compiled.

    Args:
        sizes: the compile sizes (batch sizes or token counts).
        tag: names the code objects (the backend's phase, as for the forward).
        phase: ``"decode"`` or ``"prefill"``, for host-value guard messages.
        backend: the Dynamo backend (compiled full's, counting body graphs).
        label: the backend's name, for host-value guard messages.
        guard_scope: the runner's host-value guard scope (``CapturePlan.host_value_guard``);
            ``"off"`` (the config turned the guard off) leaves a body's host reads free, as
            the capture does.
    """
    limit = ENTRIES_PER_SIZE * max(1, len(sizes))
    settings = functools.partial(_body_settings, label, phase, guard_scope, limit)
    return {
        size: {
            name: _compiled_body(op.fn, f"full_compiled_op_{name}_{tag}_{size}", backend, settings)
            for name, op in registered_eager_ops().items()
        }
        for size in sizes
    }


def _compiled_body(
    fn: Callable[..., Any], name: str, backend: Callable[..., Any], settings: Callable[[], Any]
) -> Callable[..., Any]:
    with precompile_paused():
        compiled = torch.compile(entry_function(fn, name), backend=backend, dynamic=False)

    def body(*args: Any, **kwargs: Any) -> Any:
        with settings():
            return compiled(*args, **kwargs)

    return body


@contextlib.contextmanager
def _body_settings(label: str, phase: str, guard_scope: str, limit: int) -> Iterator[None]:
    import torch._dynamo.config as dynamo_config

    # torch renamed cache_size_limit to recompile_limit (2.6); the old name is an alias.
    key = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    patch = {key: max(limit, getattr(dynamo_config, key))}
    if hasattr(dynamo_config, "accumulated_recompile_limit"):
        patch["accumulated_recompile_limit"] = max(4 * limit, dynamo_config.accumulated_recompile_limit)
    with (
        dynamo_config.patch(**patch),
        precompile_paused(),
        host_value_guard(label, phase, guard_scope),
    ):
        yield
