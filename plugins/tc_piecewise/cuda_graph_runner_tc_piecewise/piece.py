"""A compiled piece that, per size, warms up, captures into the shared pool, then replays.

The backend says what is going on through an *activity* (a context variable): the mode
(compile pass, warm-up, capture, replay, plain run) and the :class:`ShapeKey` being
worked on. Each piece reads it on every call (sglang ``CUDAPiecewiseBackend``, vLLM
``CUDAGraphWrapper`` with ``runtime_mode=PIECEWISE``):

* ``COMPILE`` (the backend's compile pass) and ``WARMUP``: run the compiled piece;
* ``CAPTURE``: record the compiled piece into one ``CUDAGraph`` in the backend's pool, on
  its capture stream, and keep the output;
* ``REPLAY``: replay the key's graph and return the output kept at capture; a key with
  no graph (a size outside the captured list) runs the compiled piece instead;
* no activity of this piece's backend: run the compiled piece.

Outputs keep their addresses: every replay returns the very tensors the capture call
produced, so the eager op after a piece and the next piece read what they read when
they were captured. On CUDA those tensors are kept as *weak references* (non-owning
aliases, :func:`cuda_graph_runner.backend.weak_ref.weak_ref_tensors`): the capture call returns the real tensors,
whose blocks go back to the graph pool once the capture-time forward drops them, so
later captures (other sizes) reuse them instead of every size pinning its activations.
This is safe because the pool is shared only by graphs that never replay at the same
time, and within one forward the capture-time lifetimes are the replay-time ones.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import unittest.mock
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from cuda_graph_runner.backend import ShapeKey, breaks_refused, weak_ref_tensors

from .errors import TcPiecewiseRuntimeError, failing_line, one_line


class Mode(enum.Enum):
    """What the backend is doing while the compiled forward runs."""

    COMPILE = "compile"  # prepare()'s compile pass: compile, never capture
    WARMUP = "warmup"  # capture_one's warm-up call
    CAPTURE = "capture"  # capture_one's recording call
    REPLAY = "replay"  # replay the key's graphs (compiled pieces if it has none)


@dataclasses.dataclass(frozen=True)
class Activity:
    """The current activity of one backend (``owner``)."""

    owner: Any
    mode: Mode
    key: Optional[ShapeKey] = None


_ACTIVITY: contextvars.ContextVar[Optional[Activity]] = contextvars.ContextVar(
    "cuda_graph_runner_tc_piecewise_activity", default=None
)


def current_activity() -> Optional[Activity]:
    """The activity set by the innermost :func:`activity` block, or None."""
    return _ACTIVITY.get()


@contextlib.contextmanager
def activity(owner: Any, mode: Mode, key: Optional[ShapeKey] = None) -> Iterator[Activity]:
    """Make ``(owner, mode, key)`` the current activity for the block (re-entrant)."""
    act = Activity(owner, mode, key)
    token = _ACTIVITY.set(act)
    try:
        yield act
    finally:
        _ACTIVITY.reset(token)


def _tensor_ptrs(args: Tuple[Any, ...]) -> List[Optional[int]]:
    return [a.data_ptr() if isinstance(a, torch.Tensor) else None for a in args]


@contextlib.contextmanager
def _no_gc_nor_empty_cache(device_module: Any) -> Iterator[None]:
    # torch.cuda.graph() runs gc.collect() and empty_cache() on entry; once per piece per
    # size that dominates capture time (vLLM's gc_disable for every piece but the first).
    with contextlib.ExitStack() as stack:
        stack.enter_context(unittest.mock.patch("gc.collect", lambda *a, **k: 0))
        if hasattr(device_module, "empty_cache"):
            stack.enter_context(unittest.mock.patch.object(device_module, "empty_cache", lambda *a, **k: None))
        yield


@dataclasses.dataclass
class _Entry:
    graph: Any
    output: Any
    input_ptrs: Optional[List[Optional[int]]] = None


class GraphPiece:
    """One compiled piece of the split graph, with one graph per captured :class:`ShapeKey`.

    Args:
        owner: the backend (``TcPiecewiseCudaGraphBackend``); read for ``device_module``,
            ``memory_pool``, ``capture_stream``, ``capture_enabled``,
            ``weak_ref_outputs`` and ``debug``.
        compiled: the compiled piece, ``compiled(*args) -> tensor or tuple``.
        description: how error messages name the piece (index, marked ops around it, ops).
        is_first: the first piece of its graph (it alone lets ``torch.cuda.graph`` run
            ``gc.collect()`` / ``empty_cache()`` before a capture).

    Attributes:
        calls: calls per mode (``"compile"``, ``"warmup"``, ``"capture"``, ``"replay"``,
            ``"run"``: compiled without a graph, outside any capture or for an uncaptured
            key).
    """

    def __init__(self, owner: Any, compiled: Any, *, name: str, description: str, is_first: bool) -> None:
        # Weak: Dynamo's cache (out of the garbage collector's reach) holds the pieces, so a
        # strong reference would keep the backend, its runner and its graphs alive forever.
        self._owner = weakref.ref(owner)
        self.compiled = compiled
        self.name = name
        self.description = description
        self.is_first = is_first
        self.entries: Dict[ShapeKey, _Entry] = {}
        self.calls: Dict[str, int] = {"compile": 0, "warmup": 0, "capture": 0, "replay": 0, "run": 0}

    @property
    def owner(self) -> Any:
        """The backend (None once it is gone)."""
        return self._owner()

    def __call__(self, *args: Any) -> Any:
        act = _ACTIVITY.get()
        if act is None or act.owner is not self._owner():
            self.calls["run"] += 1
            return self.compiled(*args)
        mode = act.mode
        if mode is Mode.REPLAY:
            entry = self.entries.get(act.key)  # type: ignore[arg-type]
            if entry is None:
                self.calls["run"] += 1
                return self.compiled(*args)
            if entry.input_ptrs is not None:
                self._check_inputs(act.key, entry, args)
            self.calls["replay"] += 1
            entry.graph.replay()
            return entry.output
        try:
            if mode is Mode.CAPTURE and self.owner.capture_enabled:
                self.calls["capture"] += 1
                return self._capture(act.key, args)
            self.calls[mode.value] += 1
            return self.compiled(*args)
        except TcPiecewiseRuntimeError:
            raise
        except Exception as exc:
            at = failing_line(exc)
            raise TcPiecewiseRuntimeError(
                f"tc_piecewise: {self.description} failed during {mode.value} of {act.key}: {one_line(exc)}"
                + (f" [at: {at}]" if at else "")
            ) from exc

    def _capture(self, key: Optional[ShapeKey], args: Tuple[Any, ...]) -> Any:
        if key is None:
            raise RuntimeError(f"tc_piecewise: {self.name} asked to capture without a shape key")
        refused = breaks_refused()
        if refused is not None:  # the pieces end at every marked op, which then runs eagerly
            raise TcPiecewiseRuntimeError(
                f"tc_piecewise: {self.name} of {key} cannot be captured here: tc_piecewise runs every marked op "
                f"eagerly between its pieces, and this forward refuses that ({refused}); use backend full"
            )
        if key in self.entries:
            raise RuntimeError(f"tc_piecewise: {self.name} already holds a graph for {key}; cleanup() first")
        owner = self.owner
        dm = owner.device_module
        graph = owner.new_graph(dm.CUDAGraph)  # template kept only for describe()
        # Only the session's first graph empties the caches (BaseCudaGraphBackend.graph_capture);
        # gc.collect stays off for every piece after a size's first.
        quiet = contextlib.nullcontext() if self.is_first else _no_gc_nor_empty_cache(dm)
        with quiet, owner.graph_capture(graph):
            output = self.compiled(*args)
        owner.finish_graph(graph)
        kept = weak_ref_tensors(output) if owner.weak_ref_outputs else output
        self.entries[key] = _Entry(graph, kept, _tensor_ptrs(args) if owner.debug else None)
        # The real tensors go back to the caller so the capture-time forward holds them
        # exactly as long as it needs them (then their blocks return to the pool).
        return output

    def _check_inputs(self, key: Any, entry: _Entry, args: Tuple[Any, ...]) -> None:
        now = _tensor_ptrs(args)
        moved = [i for i, (a, b) in enumerate(zip(entry.input_ptrs or [], now)) if a != b]
        if moved:
            raise RuntimeError(
                f"tc_piecewise debug: {self.description} replayed for {key} with inputs {moved} at other "
                "addresses than at capture; the graph would read stale memory"
            )

    def discard(self, key: ShapeKey) -> None:
        """Drop ``key``'s graph (``graph.reset()``) and kept output; nothing when absent."""
        entry = self.entries.pop(key, None)
        reset = getattr(entry.graph, "reset", None) if entry is not None else None
        if reset is not None:
            reset()

    def reset(self) -> None:
        """Drop every graph (``graph.reset()``) and kept output."""
        for entry in self.entries.values():
            reset = getattr(entry.graph, "reset", None)
            if reset is not None:
                reset()
        self.entries.clear()

    def __repr__(self) -> str:
        return f"GraphPiece({self.name}, sizes={sorted(k.size for k in self.entries)})"
