"""Graph-break API: how model code marks the ops that must run eagerly between graph pieces.

Attention over variable-length metadata cannot be frozen into a graph for prefill: its
launch configuration depends on per-request lengths that change every batch. Model code
marks such an op once; backends then decide what to do with it:

* ``full`` captures it like any other op (it must be capture-safe for that phase);
* ``breakable`` ends the current graph segment at the op, runs the op eagerly at replay
  on the live batch, and begins the next segment (sglang's breakable CUDA graph), except
  where the op declares itself capture-safe for the batch's forward mode (below): there
  it records the op inside the segment, as ``full`` would;
* ``tc_piecewise`` splits the torch.compile FX graph at the op (vLLM's ``splitting_ops``).

Capture-safe modes (``capture_safe=``): an op whose work is fixed by the captured shape
in some forward modes (attention in fixed-width decode: one query row per request, every
length read from device tensors) declares those modes, e.g.
``@eager_op("attn", capture_safe=("decode", "target_verify"))``. The declaration is a
promise, for a batch of such a mode, that the op

* launches the same kernels with the same shapes for every batch of the captured shape
  (shapes come from tensor shapes and fields the runner fixes per shape: the forward mode,
  ``num_tokens_per_req``), so a replay of the capture is the right computation;
* reads every per-batch value from device tensors at stable addresses (the runner's
  static buffers, the KV cache, ``req_to_token``), never from host fields of the batch
  (``seq_lens_cpu``, ``extend_*_cpu``, host values in ``extra``) nor from device values
  brought to the host (``.item()``, ``.tolist()``, data-dependent shapes, ``nonzero``);
* keeps per-forward metadata only in :func:`~cuda_graph_runner.backend.context.forward_scratch`
  (recorded into the graph with the rest), not in Python state that outlives the forward.

A *plan-based* op (its kernels read metadata a host ``plan()`` wrote into buffers:
FlashInfer's wrappers, sglang's ``init_forward_metadata_replay_cuda_graph``) is
capture-safe only together with its replay hook: the model's
``init_forward_metadata_replay(static_batch)`` (:mod:`cuda_graph_runner.runner.model_protocol`)
re-plans before every replay, from the static batch's host lengths, into the same
buffers the graph recorded. Without that hook the graph replays the last plan, silently.

A backend may then record the op into its graph for those modes (``breakable`` does,
so a decode step is one graph instead of one segment per layer: vLLM's
``FULL_AND_PIECEWISE`` split of uniform decode from mixed batches, and its attention
backends' ``AttentionCGSupport.UNIFORM_BATCH`` declaration). In the other modes the op
breaks the graph like any marked op. While a backend records such an op, the host-value guard
stays armed inside it (:mod:`cuda_graph_runner.backend.host_guard`), so a host read breaking the
promise is an error at capture rather than a silently frozen value.

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

    @eager_op("my_attention", capture_safe=("decode", "target_verify"))
    def my_attention(output: torch.Tensor, q: torch.Tensor, layer_id: int) -> None:
        ...                                  # decode: device metadata only (captured by breakable)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import types
from typing import Any, Callable, Dict, FrozenSet, Iterable, Iterator, Mapping, Optional, Protocol, Sequence, Union

import torch

from .errors import CudaGraphHostValueError
from .forward_batch import ForwardBatch, ForwardMode
from .host_guard import run_marked_op

NAMESPACE = "cuda_graph_runner"

#: What ``capture_safe=`` accepts: ``False`` (never; the default), ``True`` (every mode),
#: forward modes (:class:`~cuda_graph_runner.backend.forward_batch.ForwardMode` members or their
#: values ``"decode"``, ``"target_verify"``, ``"extend"``), or a predicate over the batch
#: being captured.
CaptureSafe = Union[bool, str, ForwardMode, Iterable[Union[str, ForwardMode]], Callable[[ForwardBatch], bool]]

#: The fixed-width modes the decode runner keys by batch size (``ForwardMode.is_decode_like``).
DECODE_LIKE_MODES = ("decode", "target_verify")


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
        capture_safe: where the op may be recorded into a graph (see the module docstring):
            ``False``, ``True``, a frozenset of :class:`ForwardMode` members, or a predicate
            ``(batch) -> bool``. Read it through :meth:`is_capture_safe`.
    """

    name: str
    qualname: str
    fn: Callable[..., Any]
    custom_op: Any
    capture_safe: Union[bool, FrozenSet[ForwardMode], Callable[[ForwardBatch], bool]] = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            # Under Dynamo: record the custom op (where tc_piecewise splits) and keep the
            # thread-local handler lookup out of the trace.
            return self.custom_op(*args, **kwargs)
        handler = _state.handler
        if handler is not None:
            return handler(self, args, kwargs)
        return self.custom_op(*args, **kwargs)

    def is_capture_safe(self, batch: Optional[ForwardBatch]) -> bool:
        """Whether the op promised to be capture-safe for ``batch`` (the batch being
        captured; ``None`` outside any forward context: only ``capture_safe=True`` holds
        then). A backend asks it at capture, once per call of the op.

        Raises:
            CudaGraphHostValueError: a predicate read a host value of a guarded batch
                (a predicate may look at the mode and shapes only).
            RuntimeError: a predicate raised anything else (chained), naming the op.
        """
        safe = self.capture_safe
        if isinstance(safe, bool):
            return safe
        if batch is None:
            return False
        if isinstance(safe, frozenset):
            return batch.forward_mode in safe
        try:
            return bool(safe(batch))
        except CudaGraphHostValueError:
            raise
        except Exception as exc:
            raise RuntimeError(
                f"the capture_safe predicate of marked op {self.qualname!r} raised {type(exc).__name__}: {exc}"
            ) from exc


class _State(threading.local):
    handler: Optional[BreakHandler] = None
    bodies: Optional[Mapping[str, Callable[..., Any]]] = None
    breaks_refused: Optional[str] = None


@contextlib.contextmanager
def refuse_breaks(reason: str) -> Iterator[None]:
    """Inside the block a backend must not break its graph at a marked op (it raises,
    naming the op and ``reason``): for forwards whose eager replay would read the wrong
    batch, like a draft runner's steps after the first (at replay an eager op sees the
    runner's static batch, which describes step 0)."""
    previous = _state.breaks_refused
    _state.breaks_refused = reason
    try:
        yield
    finally:
        _state.breaks_refused = previous


def breaks_refused() -> Optional[str]:
    """Why a backend may not break at a marked op now (:func:`refuse_breaks`), or None."""
    return _state.breaks_refused


_state = _State()
_registry: Dict[str, EagerOp] = {}


def eager_op(
    name: str, *, mutates_args: Sequence[str] = ("output",), capture_safe: CaptureSafe = False
) -> Callable[[Callable[..., None]], EagerOp]:
    """Decorator: register ``fn`` as a marked eager op named ``name``.

    ``fn`` must be fully type-annotated (torch infers the custom-op schema from the
    annotations), return ``None`` and write its result into the arguments named in
    ``mutates_args`` (default ``("output",)``).

    ``capture_safe`` declares the forward modes in which the op keeps the capture-safety
    promise of the module docstring (fixed shapes for the captured size, metadata from
    device tensors only, no host reads or syncs), so a backend may record it into a graph
    there instead of breaking at it: ``False`` (default: never), ``True`` (every mode), a
    mode or a collection of modes (``"decode"``, ``"target_verify"``, ``"extend"`` or
    :class:`ForwardMode` members; :data:`DECODE_LIKE_MODES` for both fixed-width modes),
    or a predicate ``(batch: ForwardBatch) -> bool`` evaluated at capture on the batch
    being captured (it may read the mode and tensor shapes, not host values, and must
    answer the same for every batch of one captured shape).

    Raises:
        ValueError: ``name`` is already registered with another function (or the same
            function with another ``capture_safe``), is not an identifier, or
            ``capture_safe`` names an unknown mode (the message lists the accepted ones).
        TypeError: ``capture_safe`` is of another type.
    """

    def decorate(fn: Callable[..., None]) -> EagerOp:
        return register_eager_op(name, fn, mutates_args=mutates_args, capture_safe=capture_safe)

    return decorate


def register_eager_op(
    name: str, fn: Callable[..., None], *, mutates_args: Sequence[str] = ("output",), capture_safe: CaptureSafe = False
) -> EagerOp:
    """Function form of :func:`eager_op`. Re-registering the same ``fn`` (with the same
    ``capture_safe``) returns the existing op."""
    if not name.isidentifier():
        raise ValueError(f"eager op name {name!r} is not an identifier; use letters, digits and '_'")
    safe = normalize_capture_safe(capture_safe, name)
    existing = _registry.get(name)
    if existing is not None:
        if existing.fn is fn:
            if existing.capture_safe != safe:
                raise ValueError(
                    f"eager op {name!r} is already registered with capture_safe={existing.capture_safe!r}; "
                    f"re-registering it with capture_safe={safe!r} would change what backends capture"
                )
            return existing
        raise ValueError(
            f"eager op {name!r} is already registered by {existing.fn.__module__}.{existing.fn.__qualname__}; "
            "pick another name"
        )
    qualname = f"{NAMESPACE}::{name}"
    op = torch.library.custom_op(qualname, mutates_args=tuple(mutates_args))(_lifting_host_guard(fn, name))
    # Out-ops return nothing, so the fake (meta) implementation has nothing to compute.
    op.register_fake(lambda *args, **kwargs: None)
    marked = EagerOp(
        name=name, qualname=qualname, fn=fn, custom_op=getattr(getattr(torch.ops, NAMESPACE), name), capture_safe=safe
    )
    _registry[name] = marked
    return marked


def normalize_capture_safe(
    value: CaptureSafe, name: str = "?"
) -> Union[bool, FrozenSet[ForwardMode], Callable[[ForwardBatch], bool]]:
    """``capture_safe=`` in the form :class:`EagerOp` keeps: a bool, a frozenset of
    :class:`ForwardMode` members (an empty collection is ``False``), or the predicate.

    Raises:
        ValueError: a mode string that is no :class:`ForwardMode` value (lists the accepted).
        TypeError: anything else than a bool, a mode, a collection of modes or a callable.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, (str, ForwardMode)):
        value = (value,)
    elif callable(value):
        return value
    try:
        items = list(value)
    except TypeError:
        raise TypeError(
            f"eager op {name!r}: capture_safe={value!r} is not accepted; give a bool, forward modes "
            f"({', '.join(repr(m.value) for m in ForwardMode)}) or a predicate (batch) -> bool"
        ) from None
    modes = set()
    accepted = [m.value for m in ForwardMode]
    for item in items:
        if isinstance(item, ForwardMode):
            modes.add(item)
        elif isinstance(item, str) and item.lower() in accepted:
            modes.add(ForwardMode(item.lower()))
        else:
            raise ValueError(
                f"eager op {name!r}: capture_safe names the mode {item!r}; accepted: {accepted} or ForwardMode members"
            )
    return frozenset(modes) if modes else False


def _lifting_host_guard(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` run with the host-value guard lifted (:func:`cuda_graph_runner.backend.host_guard.run_marked_op`):
    a marked op reads live host metadata, which is fine wherever the backend runs it eagerly
    at replay. Inside :func:`marked_op_bodies` the body given for ``name`` runs instead of
    ``fn``. torch infers the custom op's schema from ``fn``'s annotations, evaluated in
    the wrapper's globals when they are strings: the wrapper gets ``fn``'s globals (it uses
    closure variables only) and ``functools.wraps`` its signature."""
    call = run_marked_op
    state = _state

    def run(*args: Any, **kwargs: Any) -> Any:
        bodies = state.bodies
        body = bodies.get(name) if bodies else None
        if body is None:
            return call(fn, args, kwargs)
        if call(body, args, kwargs) is not None:
            raise TypeError(
                f"the marked_op_bodies body for marked op {name!r} returned a value; "
                "a body writes its outputs (the op's mutated arguments) and returns None"
            )
        return None

    wrapper = types.FunctionType(run.__code__, fn.__globals__, fn.__name__, None, run.__closure__)
    return functools.wraps(fn)(wrapper)


@contextlib.contextmanager
def marked_op_bodies(bodies: Mapping[Any, Callable[..., Any]]) -> Iterator[None]:
    """In this thread, for the block, a call of the marked op named ``name`` runs
    ``bodies[name]`` (same arguments, same contract) in place of the op's Python
    implementation; ops not named run their own. The op stays the same opaque custom op
    to Dynamo and to graph captures: only what runs inside it changes.

    Compiled ``full`` gives every registered op a body compiled with inductor for each
    compile size (regional compilation, as sglang's attention backends ``torch.compile``
    their own helpers; only the ops the forward calls ever compile), so what the
    forward's graph sees as one opaque call still becomes fused kernels. A body must
    keep the op's contract (write ``output``, return None). Keys are op names or the
    :class:`EagerOp` objects. Blocks nest: the inner block's entries are added to the
    outer ones (and win for the same op) until it ends.

    Raises:
        KeyError: a key names no registered marked op (lists the registered ones).
        TypeError: ``bodies`` is not a mapping; a key is neither a name nor an
            :class:`EagerOp`, or a body is not a callable; at a call, a body returned
            something else than None.
    """
    if not isinstance(bodies, Mapping):
        raise TypeError(
            f"marked_op_bodies: bodies is {bodies!r}, not a mapping; give {{op name or EagerOp: body}}; "
            f"registered: {sorted(_registry)}"
        )
    named: Dict[str, Callable[..., Any]] = {}
    for key, body in bodies.items():
        name = key.name if isinstance(key, EagerOp) else key
        if not isinstance(name, str):
            raise TypeError(
                f"marked_op_bodies: key {key!r} is not a marked op's name; give op.name or the EagerOp; "
                f"registered: {sorted(_registry)}"
            )
        if not callable(body):
            raise TypeError(f"marked_op_bodies: the body for {name!r} is {body!r}, not a callable")
        named[name] = body
    unknown = sorted(set(named) - set(_registry))
    if unknown:
        raise KeyError(f"marked_op_bodies: no marked op named {unknown}; registered: {sorted(_registry)}")
    previous = _state.bodies
    _state.bodies = {**(previous or {}), **named}
    try:
        yield
    finally:
        _state.bodies = previous


def registered_eager_ops() -> Dict[str, EagerOp]:
    """All marked ops of this process, by name (a copy)."""
    return dict(_registry)


def is_eager_op_target(target: Any) -> bool:
    """True if an FX node target is one of the marked ops (a ``torch.ops`` overload or packet)."""
    return eager_op_for_target(target) is not None


def eager_op_for_target(target: Any) -> Optional[EagerOp]:
    """The marked op an FX node target calls (a ``torch.ops`` overload or packet), or None."""
    # Packets (what Dynamo records for a custom-op call) have no name() in recent torch,
    # only _qualified_op_name; overloads have name().
    qualname = getattr(target, "_qualified_op_name", None)
    if not isinstance(qualname, str):
        name = getattr(target, "name", None)
        qualname = name() if callable(name) else None
    if not isinstance(qualname, str):
        return None
    # OpOverload.name() gives "ns::op.overload" or "ns::op"; packets give "ns::op".
    qualname = qualname.split(".")[0]
    return next((op for op in _registry.values() if op.qualname == qualname), None)


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


def capture_safe_now(op: EagerOp) -> bool:
    """``op.is_capture_safe(batch)`` for the batch of the current
    :func:`~cuda_graph_runner.backend.context.forward_context` (``None`` outside one): what a
    backend asks when the op is called during its capture.

    Raises: as :meth:`EagerOp.is_capture_safe`.
    """
    from .context import get_forward_batch

    try:
        batch: Optional[ForwardBatch] = get_forward_batch()
    except RuntimeError:
        batch = None
    return op.is_capture_safe(batch)


def call_eagerly(op: EagerOp, args: tuple, kwargs: dict) -> Any:
    """Run a marked op's custom op directly, bypassing any handler."""
    return op.custom_op(*args, **kwargs)
