"""``BreakableCudaGraphBackend``: a graph broken into segments around the marked eager ops.

Idea from sglang's breakable CUDA graph (PR #19102; ``BreakableCUDAGraph``,
``eager_on_graph``) and vLLM's ``breakable_cudagraph.py``: one capture drives the whole
forward; every op marked with :func:`cuda_graph_runner.backend.graph_break.eager_op` ends the
current graph segment, runs once eagerly, is recorded as a replay closure, and a new
segment begins. Replay runs ``segment 0, op 0, segment 1, op 1, ..., segment N``, so the
ops that must see live, variable-length metadata (prefill attention) run on the live
batch while everything between them replays from graphs. No torch.compile.

Capture-safe ops stay inside the segments: an op that declares itself capture-safe for
the captured batch's forward mode (``eager_op(..., capture_safe=("decode", ...))``, see
:mod:`cuda_graph_runner.backend.graph_break`) is recorded into the open segment like any other
code, with the host-value guard armed inside it, instead of ending the segment. The
reference attention declares the fixed-width decode modes, so a decode step replays as
one graph (as ``full`` does, without one Python call and a few launches per layer from
the host) while prefill still breaks at every attention (vLLM's ``FULL_AND_PIECEWISE``:
full graphs for uniform decode, pieces for the rest; vLLM's breakable wrapper likewise
runs its eager break inline inside a FULL-mode forward). Ops not declared safe for the
mode break the graph, in every phase.

Memory and addresses:

* every segment of every shape is captured into the one shared graph pool, so the
  tensors a segment allocates (the op's ``output`` buffer, its inputs) stay at the
  addresses the captured kernels use;
* a marked op is replayed with its *capture-time* tensor arguments (static buffers,
  weights, KV cache, graph-pool tensors: their addresses never move), while its host
  metadata comes from ``get_forward_batch()``, which the runner points at the live batch
  around every replay;
* tensors an op *returns* were allocated between segments, outside the pool: they are
  held for the graph's lifetime and each replay copies the new result into them, so the
  next segment reads the same address (sglang's "bridge" output, held strongly).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import sys
import threading
import warnings
from typing import Any, ContextManager, Dict, Iterator, List, Optional, Tuple

import torch

from cuda_graph_runner.backend import (
    BaseCudaGraphBackend,
    CudaGraphRunnerError,
    EagerOp,
    ForwardBatch,
    ForwardFn,
    ShapeKey,
    WarmupHook,
    break_handler,
    breaks_refused,
    call_eagerly,
    capture_safe_now,
    copy_into,
    envs,
    iter_tensors,
    map_tensors,
    weak_ref_tensor,
)

from . import plugin
from .leak_check import LeakCheck

logger = logging.getLogger(__name__)

__all__ = [
    "BreakableCaptureError",
    "BreakableLeakedOutputError",
    "BreakableCudaGraphBackend",
    "BreakableGraph",
    "EagerBreak",
    "ENV_CHECK_LEAKED_OUTPUTS",
    "ENV_INLINE_SAFE_OPS",
    "ENV_WEAK_REF_ARGS",
]

#: Sets ``weak_ref_args`` for backends built without the argument (the registry builds
#: them so), e.g. to compare graph memory in a benchmark; declared in :mod:`.plugin`,
#: parsed by the core's ``envs``
#: (1/0/true/false/yes/no/on/off, anything else is an error).
ENV_WEAK_REF_ARGS = plugin.WEAK_REF_ARGS
#: Sets ``inline_capture_safe_ops`` for backends built without the argument (e.g. ``0`` to
#: measure or debug the all-breaks form); parsed by the core's ``envs`` like the one above.
ENV_INLINE_SAFE_OPS = plugin.INLINE_SAFE_OPS
#: Sets ``check_leaked_outputs`` for backends built without the argument (a debug switch,
#: off by default); parsed by the core's ``envs`` like the ones above.
ENV_CHECK_LEAKED_OUTPUTS = plugin.CHECK_LEAKED_OUTPUTS


class BreakableCaptureError(CudaGraphRunnerError, RuntimeError):
    """A breakable capture cannot proceed (nested capture, an unusable op argument, a
    segment that failed to end); the message says what to change."""


class BreakableLeakedOutputError(BreakableCaptureError):
    """The leaked-output check (``check_leaked_outputs``) found tensors a marked op made
    between segments and handed on without declaring them (:mod:`.leak_check`).

    Attributes:
        key: the shape being captured.
        leaks: the :class:`~cuda_graph_runner_breakable.leak_check.Leak` records, each
            naming the op, the reader and the tensor.
    """

    def __init__(self, key: ShapeKey, leaks: List[Any]) -> None:
        self.key = key
        self.leaks = list(leaks)
        found = "; ".join(leak.describe() for leak in self.leaks)
        super().__init__(
            f"breakable capture of {key}: {found}. A replay runs the op again into new tensors while the "
            "graph segments (and later ops, replayed with their capture-time arguments) read the capture's: "
            "stale values. Write the result into an argument the op mutates (mutates_args, 'output' by "
            "default: allocate it before the op) or return it from the op"
        )


# One breakable capture at a time per thread (CUDA allows one capture per process;
# the graph-break handler is thread-local).
_local = threading.local()


def is_capturing() -> bool:
    """True while this thread runs a breakable capture."""
    return getattr(_local, "capture", None) is not None


@dataclasses.dataclass
class EagerBreak:
    """One marked op between two segments, replayed eagerly.

    Attributes:
        op: the marked op.
        args, kwargs: its capture-time arguments (tensors at stable addresses).
        returned: what the op returned at capture, held for the graph's lifetime; each
            replay copies the new result into it. None for out-ops (the usual case).
    """

    op: EagerOp
    args: tuple
    kwargs: Dict[str, Any]
    returned: Any = None

    def run(self) -> None:
        result = call_eagerly(self.op, self.args, self.kwargs)
        if self.returned is not None:
            copy_into(self.returned, result)


@dataclasses.dataclass
class BreakableGraph:
    """The captured form of one shape: ``len(segments) == len(breaks) + 1``.

    Attributes:
        key: the shape.
        segments: device graphs (``torch.cuda.CUDAGraph``), all in one pool.
        breaks: the eager ops, ``breaks[i]`` running after ``segments[i]``.
        inlined: names of the marked ops recorded inside the segments (declared
            capture-safe for the shape's mode), in call order.
    """

    key: ShapeKey
    segments: List[Any] = dataclasses.field(default_factory=list)
    breaks: List[EagerBreak] = dataclasses.field(default_factory=list)
    inlined: List[str] = dataclasses.field(default_factory=list)

    def replay(self) -> None:
        """``segment 0, op 0, segment 1, ..., segment N`` on the current stream."""
        breaks = self.breaks
        for i, segment in enumerate(self.segments):
            segment.replay()
            if i < len(breaks):
                breaks[i].run()

    def reset(self) -> None:
        for segment in self.segments:
            segment.reset()
        self.segments.clear()
        self.breaks.clear()
        self.inlined.clear()

    @property
    def op_names(self) -> List[str]:
        return [b.op.name for b in self.breaks]


class BreakableCudaGraphBackend(BaseCudaGraphBackend):
    """Backend ``breakable``: per shape, graph segments split at the marked eager ops.

    Capture (per shape): ``num_warmups`` eager runs on the capture stream,
    ``post_warmup_hook()``, a synchronize, then one run of ``forward_fn`` in which
    segment 0 begins; each marked op ends the current segment (after joining any side
    stream forked during it), runs eagerly on the capture stream, is recorded, and the
    next segment begins; the last segment ends when ``forward_fn`` returns. Its return
    value is kept as the shape's output (overwritten by every replay, like ``full``).

    At capture a marked op runs once on inputs the segment before it has *recorded but
    not computed*: it must not act on tensor values from the host (``.item()``, data
    dependent shapes) or index with them; it reads host metadata from the forward
    context.

    A marked op declared capture-safe for the captured batch's forward mode
    (``capture_safe=`` of :func:`~cuda_graph_runner.backend.graph_break.eager_op`) does not end the
    segment: its body is recorded into it, like the model code around it, with the
    host-value guard armed (a host read there raises
    :class:`~cuda_graph_runner.backend.errors.CudaGraphHostValueError` at capture). With the
    reference model a decode shape is then one segment; prefill shapes keep one break per
    attention. ``BreakableGraph.inlined`` lists the ops so recorded.

    Args (beyond :class:`~cuda_graph_runner.backend.BaseCudaGraphBackend`'s):
        weak_ref_args: keep non-owning aliases of the ops' tensor arguments instead of
            references (CUDA only; vLLM/sglang do this), so graph-pool blocks an op
            reads can be reused by later segments and smaller shapes: much less graph
            memory for many shapes. Requires every tensor argument to be either
            persistent (weights, KV cache, static buffers) or allocated inside the
            segment before the op; False holds references and is safe for any
            argument. None (default): True unless the environment variable
            ``CUDA_GRAPH_RUNNER_BREAKABLE_WEAK_REF_ARGS`` is off (``0``, ``false``, ``no``,
            ``off``; any other non-boolean raises ``envs.EnvVarError``). The shape's outputs
            are kept as aliases too, under the same switch.
        inline_capture_safe_ops: record marked ops declared capture-safe for the batch's
            mode inside the segments (True), or break at every marked op (False: the
            behaviour before capture-safe declarations; slower decode, for comparison or
            debugging). None (default): True unless ``CUDA_GRAPH_RUNNER_BREAKABLE_INLINE_SAFE_OPS``
            is off (parsed like the variable above).
        check_leaked_outputs: a debug switch: at capture, report every tensor a marked op
            made between segments that a later segment, a later op's argument or the
            forward's output reads without it being one of the op's declared outputs
            (mutated arguments, return value) (:mod:`.leak_check`; costs capture time,
            not replay time). None (default): ``CUDA_GRAPH_RUNNER_BREAKABLE_CHECK_LEAKED_OUTPUTS``
            (off unless set).

    Raises (from ``capture_one``):
        BreakableCaptureError: nested capture; a marked op given a tensor that is not
            on the capture device (a host tensor would replay its capture-time values);
            a segment that could not end (e.g. a side stream left unjoined).
        BreakableLeakedOutputError: (``check_leaked_outputs``) a marked op leaked a
            tensor (names the op, the reader, shape and dtype); the shape is not kept.
        ValueError: the shape was already captured.
    """

    #: Marked ops run eagerly at replay on the live batch; the model body between them is
    #: frozen into segments (cuda_graph_runner.backend.host_guard).
    host_value_guard = "outside_marked_ops"

    def __init__(
        self,
        *args: Any,
        weak_ref_args: Optional[bool] = None,
        inline_capture_safe_ops: Optional[bool] = None,
        check_leaked_outputs: Optional[bool] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if weak_ref_args is None:
            weak_ref_args = envs.get(ENV_WEAK_REF_ARGS)
        self.weak_ref_args = bool(weak_ref_args)
        if inline_capture_safe_ops is None:
            inline_capture_safe_ops = envs.get(ENV_INLINE_SAFE_OPS)
        self.inline_capture_safe_ops = bool(inline_capture_safe_ops)
        if check_leaked_outputs is None:
            check_leaked_outputs = envs.get(ENV_CHECK_LEAKED_OUTPUTS)
        self.check_leaked_outputs = bool(check_leaked_outputs)
        #: Replays since construction (tests and the bench read it).
        self.num_replays = 0

    # -- capture -----------------------------------------------------------------------
    def capture_session(self, stream: Any) -> ContextManager[None]:
        if stream is None and self.device.type != "cpu" and hasattr(self.device_module, "Stream"):
            # Eager ops between segments must run on the stream the segments capture on;
            # made on this backend's device, not the current one.
            stream = self.new_stream()
        return self.bind_capture_stream(stream)

    def capture_one(self, key: ShapeKey, forward_fn: ForwardFn, *, post_warmup_hook: WarmupHook = None) -> None:
        """Warm up, then record ``forward_fn`` for ``key`` as segments and eager breaks.

        Raises:
            BreakableCaptureError: see the class docstring.
        """
        self.graph_table.check_new(key)
        self._refuse_nested(key)
        self.warm_up(forward_fn, post_warmup_hook, key=key)

        capture = _SegmentCapture(self, key)
        _local.capture = capture
        check = capture.leak_check
        try:
            with (
                self.on_capture_stream(),
                capture.tracker.installed(),
                break_handler(capture.on_op),
                check if check is not None else contextlib.nullcontext(),
            ):
                capture.begin_segment()
                try:
                    output = forward_fn()
                except BaseException:
                    capture.abort(sys.exc_info())
                    raise
                capture.end_segment()
                if check is not None:
                    check.check_output(output)
            if check is not None and check.leaks:
                raise BreakableLeakedOutputError(key, check.leaks)
        except BaseException:
            capture.graph.reset()
            raise
        finally:
            _local.capture = None
            if check is not None:
                check.forget()
        # As in ``full``: aliases let smaller shapes reuse this shape's output blocks.
        self.graph_table.add(key, capture.graph, self.output_to_keep(output, self.weak_ref_args))
        logger.debug(
            "breakable %s: %d segments, eager ops %s, recorded inside %s",
            key,
            len(capture.graph.segments),
            capture.graph.op_names,
            capture.graph.inlined,
        )

    def _refuse_nested(self, key: ShapeKey) -> None:
        if is_capturing():
            raise BreakableCaptureError(
                f"nested capture: capture_one({key}) was called while another breakable capture "
                f"({_local.capture.graph.key}) is running in this thread; CUDA graphs cannot nest"
            )
        capturing = getattr(self.device_module, "is_current_stream_capturing", None)
        if capturing is not None and capturing():
            raise BreakableCaptureError(
                f"nested capture: capture_one({key}) was called while the current stream is already "
                "capturing a graph; CUDA graphs cannot nest"
            )

    def check_op_args(self, op: EagerOp, args: tuple, kwargs: Dict[str, Any]) -> None:
        """Refuse tensor arguments a replay could not reproduce.

        Raises:
            BreakableCaptureError: a tensor argument is not on the capture device.
        """
        for where, tensor in _named_tensors(op, args, kwargs):
            if not _same_device(tensor.device, self.device):
                raise BreakableCaptureError(
                    f"marked op {op.qualname!r} was called during capture with argument {where} on "
                    f"{tensor.device}, not on the capture device {self.device}: a replay passes the op "
                    "the tensors of the capture, and a host tensor holds the values it had then "
                    "(stale metadata). Pass device tensors at stable addresses (static buffers, weights, "
                    "KV cache, tensors computed in the graph) and read host metadata inside the op "
                    "from cuda_graph_runner.backend.context.get_forward_batch()"
                )

    def freeze(self, value: Any) -> Any:
        """What a replay closure keeps of an op argument: the value, with each CUDA tensor
        in it (through tuples, NamedTuples, lists, dicts, dataclasses) replaced by a weak
        alias when ``weak_ref_args`` is on; other objects (modules, callables) as they are.
        Containers are always rebuilt, so a list the model mutates after the call does not
        change what replays pass."""
        weak = self.weak_ref_args
        return map_tensors(lambda t: weak_ref_tensor(t) if weak and t.device.type == "cuda" else t, value)

    # -- replay ------------------------------------------------------------------------
    def replay(self, key: ShapeKey, static_batch: ForwardBatch) -> Any:
        """Replay ``key``'s segments and eager ops; returns the capture's output tensors.

        The eager ops read the batch set by the caller's ``forward_context`` (the runner
        sets the live, padded static batch).

        Raises:
            KeyError: no graph for ``key``.
            BreakableCaptureError: called during a capture.
        """
        if key in self.graph_table and is_capturing():
            raise BreakableCaptureError(f"replay({key}) during a capture; replay after capture() returns")
        output = self.replay_graph(key)
        self.num_replays += 1
        return output

    # -- introspection -----------------------------------------------------------------
    def graph(self, key: ShapeKey) -> BreakableGraph:
        """The segments and eager ops of ``key``.

        Raises:
            KeyError: not captured.
        """
        return self.graph_table.graph(key)

    def describe_graph(self, key: ShapeKey) -> Dict[str, Any]:
        """``{"segments", "ops_between", "inlined", "nodes", "kernels", "segment_nodes"}``
        of ``key``: the number of graph segments, the marked ops replayed eagerly between
        them (``ops_between[i]`` after segment ``i``), the marked ops recorded inside the
        segments, and node/kernel counts summed over the segments and per segment (None
        where torch cannot tell: :mod:`cuda_graph_runner.backend.graph_nodes`); ``{}`` for a key
        not captured."""
        if key not in self.graph_table:
            return {}
        from cuda_graph_runner.backend import graph_node_counts

        graph = self.graph(key)
        counts = [graph_node_counts(segment) for segment in graph.segments]
        known = all(c is not None for c in counts) and bool(counts)
        return {
            "segments": len(graph.segments),
            "ops_between": graph.op_names,
            "inlined": list(graph.inlined),
            "nodes": sum(c["nodes"] for c in counts if c) if known else None,
            "kernels": sum(c["kernels"] for c in counts if c) if known else None,
            "segment_nodes": [c["nodes"] if c else None for c in counts],
        }


class _SegmentCapture:
    """State of one shape's capture: the open segment and the break handler."""

    def __init__(self, backend: BreakableCudaGraphBackend, key: ShapeKey) -> None:
        self.backend = backend
        self.dm = backend.device_module
        self.pool = backend.memory_pool
        self.stream = backend.capture_stream
        self.graph = BreakableGraph(key)
        self.tracker = _ForkTracker(self.dm, self.stream)
        self._ctx: Any = None
        self._in_op = False
        self.leak_check: Optional[LeakCheck] = LeakCheck() if backend.check_leaked_outputs else None

    def begin_segment(self) -> None:
        segment = self.backend.new_graph(self.dm.CUDAGraph)  # template kept only for describe()
        # Caches emptied before the session's first segment only (BaseCudaGraphBackend.graph_capture).
        ctx = self.backend.graph_capture(segment)
        ctx.__enter__()
        self.graph.segments.append(segment)
        self._ctx = ctx
        self.tracker.active = True

    def end_segment(self) -> None:
        index = len(self.graph.segments) - 1
        # A forked stream left unjoined makes capture_end fail ("unjoined"): join first.
        self.tracker.join()
        ctx, self._ctx = self._ctx, None
        try:
            with warnings.catch_warnings():
                # A segment may legitimately hold no kernel (two marked ops in a row).
                warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
                ctx.__exit__(None, None, None)
            self.backend.finish_graph(self.graph.segments[index])
        except Exception as exc:
            raise BreakableCaptureError(
                f"segment {index} of {self.graph.key} could not end its capture: {exc}. Common causes: a "
                "host sync or host-dependent op inside the segment, or a side stream forked from the capture "
                "stream and joined only through Event.wait (fork/join with Stream.wait_stream so the backend "
                "can join it)"
            ) from exc

    def abort(self, exc_info: Tuple[Any, Any, Any]) -> None:
        """End the open segment after an error, keeping the original error."""
        ctx, self._ctx = self._ctx, None
        self.tracker.active = False
        if ctx is None:
            return
        try:
            ctx.__exit__(*exc_info)
        except Exception:  # capture_end of an invalidated capture raises too
            logger.debug("ending the capture after an error raised as well", exc_info=True)

    def on_op(self, op: EagerOp, args: tuple, kwargs: Dict[str, Any]) -> Any:
        if self._in_op:
            # A marked op inside another's eager run: part of the same eager region.
            return call_eagerly(op, args, kwargs)
        if self._ctx is None:
            raise BreakableCaptureError(f"marked op {op.qualname!r} called while no segment is open")
        if self.backend.inline_capture_safe_ops and capture_safe_now(op):
            # The op promised fixed shapes and device-only metadata for this mode: record it
            # into the open segment. ``op.fn`` directly, not the custom op: the custom op
            # lifts the host-value guard, which must stay armed over recorded code.
            self.graph.inlined.append(op.name)
            return op.fn(*args, **kwargs)
        refused = breaks_refused()
        if refused is not None:
            raise BreakableCaptureError(
                f"marked op {op.qualname!r} would run eagerly between graph segments: {refused}"
            )
        self.backend.check_op_args(op, args, kwargs)
        self.end_segment()
        check = self.leak_check
        self._in_op = True
        try:
            if check is None:
                result = call_eagerly(op, args, kwargs)
            else:
                check.check_args(op, _named_tensors(op, args, kwargs))
                result = check.run_op(op, lambda: call_eagerly(op, args, kwargs))
        finally:
            self._in_op = False
        freeze = self.backend.freeze
        with check.paused() if check is not None else contextlib.nullcontext():
            self.graph.breaks.append(
                EagerBreak(
                    op=op,
                    args=tuple(freeze(a) for a in args),
                    kwargs={k: freeze(v) for k, v in kwargs.items()},
                    returned=result if _has_tensor(result) else None,
                )
            )
        if check is not None:
            check.next_segment()
        self.begin_segment()
        return result


class _ForkTracker:
    """Joins side streams forked from the capture stream before a segment ends.

    While a segment captures, ``Stream.wait_event`` of the device module's stream class
    is wrapped to note every stream that waits on an event (``s.wait_stream(capture)``
    forks ``s`` into the capture). Before the segment ends, each noted stream that is
    still capturing is joined back (``capture.wait_stream(s)``); CUDA refuses to end a
    capture with an unjoined fork (sglang's breakable graph does the same).

    Model code that forks before a marked op and joins after it (``cur.wait_stream(s)``
    in the next segment) would then wait on work of an earlier capture, which CUDA
    rejects (capture isolation); ``Stream.wait_stream`` is wrapped too, so such a join of
    a stream this tracker already joined is skipped: the earlier segment, which replays
    first on the same stream, already contains that work.
    """

    def __init__(self, dm: Any, capture_stream: Any) -> None:
        self.dm = dm
        self.capture_stream = capture_stream
        self.active = False
        self.forked: List[Any] = []
        self.joined: List[Any] = []

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        cls = getattr(self.dm, "Stream", None)
        wait_event_0 = getattr(cls, "wait_event", None) if cls is not None else None
        wait_stream_0 = getattr(cls, "wait_stream", None) if cls is not None else None
        if self.capture_stream is None or wait_event_0 is None:
            yield
            return
        tracker = self

        @functools.wraps(wait_event_0)
        def wait_event(stream: Any, event: Any) -> None:
            wait_event_0(stream, event)
            if tracker.active and not _same_stream(stream, tracker.capture_stream):
                tracker.forked.append(stream)

        patches: dict[str, Any] = {"wait_event": wait_event}
        if wait_stream_0 is not None:

            @functools.wraps(wait_stream_0)
            def wait_stream(stream: Any, other: Any) -> None:
                if tracker.active and _contains(tracker.joined, other) and not tracker.is_capturing(other):
                    return
                wait_stream_0(stream, other)

            patches["wait_stream"] = wait_stream
        saved = {name: cls.__dict__[name] for name in patches if name in cls.__dict__}
        for name, fn in patches.items():
            setattr(cls, name, fn)
        try:
            yield
        finally:
            for name in patches:
                if name in saved:
                    setattr(cls, name, saved[name])
                else:
                    delattr(cls, name)

    def join(self) -> None:
        """Join every stream forked during the open segment back into the capture stream."""
        self.active = False
        forked, self.forked = self.forked, []
        for stream in forked:
            if _contains(self.joined, stream) and not self.is_capturing(stream):
                continue
            if self.is_capturing(stream):
                self.capture_stream.wait_stream(stream)
                if not _contains(self.joined, stream):
                    self.joined.append(stream)

    def is_capturing(self, stream: Any) -> bool:
        query = getattr(self.dm, "is_current_stream_capturing", None)
        if query is None:
            return True
        with self.dm.stream(stream):
            return bool(query())


def _contains(streams: List[Any], stream: Any) -> bool:
    return any(_same_stream(stream, s) for s in streams)


# -- helpers -------------------------------------------------------------------------------


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index


def _same_stream(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False


def _has_tensor(value: Any) -> bool:
    return next(iter_tensors(value), None) is not None


def _named_tensors(op: EagerOp, args: tuple, kwargs: Dict[str, Any]) -> Iterator[Tuple[str, torch.Tensor]]:
    try:
        bound = inspect.signature(op.fn).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = {**{f"#{i}": a for i, a in enumerate(args)}, **kwargs}

    for name, value in bound.items():
        for path, tensor in iter_tensors(value, where=name):
            yield repr(path), tensor
