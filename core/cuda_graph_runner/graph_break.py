"""Graph-break API: how model code marks the ops that must run eagerly between graph pieces.

Attention over variable-length metadata cannot be frozen into a graph for prefill: its
launch configuration depends on per-request lengths that change every batch. Model code
marks such an op once; backends then decide what to do with it:

* ``full`` captures it like any other op (it must be capture-safe for that phase);
* ``breakable`` ends the current graph segment at the op, runs the op eagerly at replay
  on the live batch, and begins the next segment (sglang's breakable CUDA graph);
* ``tc_piecewise`` splits the torch.compile FX graph at the op (vLLM's ``splitting_ops``).

A marked op is registered as a torch custom op in the ``cuda_graph_runner`` namespace
so Dynamo does not trace into it, and it writes its result into a caller-allocated
``output`` tensor (an *out* op): the piece before it allocates the buffer inside the
graph pool, so the address the next piece reads never moves. Model code imports only
this module, never a plugin.

Example::

    @eager_op("my_model_attention")
    def attention(output: torch.Tensor, q: torch.Tensor, layer_id: int) -> None:
        batch = get_forward_batch()          # live metadata, host side
        output.copy_(...)

    attention(out, q, 3)                     # runs, or breaks the graph, as the backend says
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import types
from typing import Any, Callable, Dict, Iterator, Optional, Protocol, Sequence

import torch

from .host_guard import run_marked_op

NAMESPACE = "cuda_graph_runner"


class BreakHandler(Protocol):
    """What a backend installs to intercept marked ops (see :func:`break_handler`)."""

    def __call__(self, op: "EagerOp", args: tuple, kwargs: dict) -> Any: ...


@dataclasses.dataclass(frozen=True)
class EagerOp:
    """A marked op. Call it like the function it wraps.

    Attributes:
        name: the op's short name; unique per process.
        qualname: ``"cuda_graph_runner::<name>"``, the custom op's name in ``torch.ops``
            (what FX graphs show as the call target).
        fn: the Python implementation.
        custom_op: the ``torch.ops`` overload packet (what Dynamo records).
    """

    name: str
    qualname: str
    fn: Callable[..., Any]
    custom_op: Any

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            # Under Dynamo: record the custom op (where tc_piecewise splits) and keep the
            # thread-local handler lookup out of the trace.
            return self.custom_op(*args, **kwargs)
        handler = _state.handler
        if handler is not None:
            return handler(self, args, kwargs)
        return self.custom_op(*args, **kwargs)


class _State(threading.local):
    handler: Optional[BreakHandler] = None


_state = _State()
_registry: Dict[str, EagerOp] = {}


def eager_op(name: str, *, mutates_args: Sequence[str] = ("output",)) -> Callable[[Callable[..., None]], EagerOp]:
    """Decorator: register ``fn`` as a marked eager op named ``name``.

    ``fn`` must be fully type-annotated (torch infers the custom-op schema from the
    annotations), return ``None`` and write its result into the arguments named in
    ``mutates_args`` (default ``("output",)``).

    Raises:
        ValueError: ``name`` is already registered with another function, or is not an
            identifier.
    """

    def decorate(fn: Callable[..., None]) -> EagerOp:
        return register_eager_op(name, fn, mutates_args=mutates_args)

    return decorate


def register_eager_op(name: str, fn: Callable[..., None], *, mutates_args: Sequence[str] = ("output",)) -> EagerOp:
    """Function form of :func:`eager_op`. Re-registering the same ``fn`` returns the existing op."""
    if not name.isidentifier():
        raise ValueError(f"eager op name {name!r} is not an identifier; use letters, digits and '_'")
    existing = _registry.get(name)
    if existing is not None:
        if existing.fn is fn:
            return existing
        raise ValueError(
            f"eager op {name!r} is already registered by {existing.fn.__module__}.{existing.fn.__qualname__}; "
            "pick another name"
        )
    qualname = f"{NAMESPACE}::{name}"
    op = torch.library.custom_op(qualname, mutates_args=tuple(mutates_args))(_lifting_host_guard(fn))
    # Out-ops return nothing, so the fake (meta) implementation has nothing to compute.
    op.register_fake(lambda *args, **kwargs: None)
    marked = EagerOp(name=name, qualname=qualname, fn=fn, custom_op=getattr(getattr(torch.ops, NAMESPACE), name))
    _registry[name] = marked
    return marked


def _lifting_host_guard(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run with the host-value guard lifted (:func:`cuda_graph_runner.host_guard.run_marked_op`):
    a marked op reads live host metadata, which is fine wherever the backend runs it eagerly
    at replay. torch infers the custom op's schema from ``fn``'s annotations, evaluated in
    the wrapper's globals when they are strings: the wrapper gets ``fn``'s globals (it uses
    closure variables only) and ``functools.wraps`` its signature."""
    call = run_marked_op

    def run(*args: Any, **kwargs: Any) -> Any:
        return call(fn, args, kwargs)

    wrapper = types.FunctionType(run.__code__, fn.__globals__, fn.__name__, None, run.__closure__)
    return functools.wraps(fn)(wrapper)


def registered_eager_ops() -> Dict[str, EagerOp]:
    """All marked ops of this process, by name (a copy)."""
    return dict(_registry)


def is_eager_op_target(target: Any) -> bool:
    """True if an FX node target is one of the marked ops (a ``torch.ops`` overload or packet)."""
    # Packets (what Dynamo records for a custom-op call) have no name() in recent torch,
    # only _qualified_op_name; overloads have name().
    qualname = getattr(target, "_qualified_op_name", None)
    if not isinstance(qualname, str):
        name = getattr(target, "name", None)
        qualname = name() if callable(name) else None
    if not isinstance(qualname, str):
        return False
    # OpOverload.name() gives "ns::op.overload" or "ns::op"; packets give "ns::op".
    return qualname.split(".")[0] in {op.qualname for op in _registry.values()}


@contextlib.contextmanager
def break_handler(handler: BreakHandler) -> Iterator[None]:
    """Route every marked-op call in this thread to ``handler`` for the block.

    Used by backends that break graphs at marked ops. Nesting is an error: two
    handlers at once would mean two captures at once, which CUDA graphs forbid.

    Raises:
        RuntimeError: a handler is already installed in this thread.
    """
    if _state.handler is not None:
        raise RuntimeError("a graph-break handler is already active in this thread; captures cannot nest")
    _state.handler = handler
    try:
        yield
    finally:
        _state.handler = None


def call_eagerly(op: EagerOp, args: tuple, kwargs: dict) -> Any:
    """Run a marked op's custom op directly, bypassing any handler."""
    return op.custom_op(*args, **kwargs)
