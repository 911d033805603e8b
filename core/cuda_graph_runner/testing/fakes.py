"""Test doubles for running runner and backend code on a machine without a GPU.

* :class:`FakeGraphDeviceModule` stands in for ``torch.cuda`` (the graph API part) and
  records every call, so a backend's capture protocol (warm-ups, hook, capture into the
  pool, replay) can be checked on the CPU. Its graphs record nothing: replay is a no-op.
* :class:`RecordingBackend` is a complete backend whose "replay" re-runs the forward
  captured for that shape and copies the result into the tensors the capture returned,
  which is what a real graph replay does to its outputs. Runner policy (sizes, order,
  padding, slicing, fallback) can then be checked on real values on the CPU.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Tuple

import torch

from ..backend.base import BaseCudaGraphBackend, ForwardFn, ShapeKey
from ..backend.buffers import copy_into
from ..backend.forward_batch import ForwardBatch
from ..backend.nested import map_tensors

Event = Tuple[Any, ...]


@contextlib.contextmanager
def recording_capture(module: Any, graph: Any, begin: Event) -> Iterator[None]:
    """The bookkeeping of one capture on a recording graph module (this one, or a
    plugin's fake ``torch.npu``): ``begin`` and then ``("capture_end", graph.id)`` in
    ``module.events``, ``module.capturing`` is ``graph`` inside the block, and
    ``graph.captured`` is set afterwards (also when the block raised, as a real capture
    leaves its graph).

    Args:
        module: has ``events`` (a list) and ``capturing`` (None outside a capture).
        graph: has ``id`` and ``captured``.
        begin: the event that opens the capture, ``("capture_begin", graph.id, ...)``.

    Raises:
        RuntimeError: ``module`` is already capturing (nested capture).
    """
    if module.capturing is not None:
        raise RuntimeError("nested graph capture")
    module.events.append(begin)
    module.capturing = graph
    try:
        yield
    finally:
        module.capturing = None
        graph.captured = True
        module.events.append(("capture_end", graph.id))


class FakeGraph:
    """A recording stand-in for ``torch.cuda.CUDAGraph``."""

    _ids = itertools.count()

    def __init__(self, module: "FakeGraphDeviceModule") -> None:
        self.module = module
        self.id = next(self._ids)
        self.captured = False
        module.record_device("CUDAGraph", None)

    def replay(self) -> None:
        if not self.captured:
            raise RuntimeError("replay of a graph that was never captured")
        self.module.record_device("replay", None)
        self.module.events.append(("replay", self.id))

    def reset(self) -> None:
        self.captured = False
        self.module.record_device("reset", None)
        self.module.events.append(("reset", self.id))


class FakeStream:
    """A stand-in for ``torch.cuda.Stream``: remembers the device index it was made on
    (``device=None``: the module's current device, as torch does)."""

    module: "FakeGraphDeviceModule" = None  # type: ignore[assignment]  # set per module

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        module = type(self).module
        self.device_index = module.index_of(device) if module is not None else None
        if module is not None:
            module.record_device("Stream", self.device_index)

    def __repr__(self) -> str:
        return "FakeStream"

    def pool(self) -> Any:
        return self.module.pool_handle


class FakeGraphDeviceModule:
    """Records the graph API calls a backend makes (``events``), for CPU tests.

    It also plays a multi-device module: ``current_device()`` starts at
    ``current_device`` (default 0), ``device(d)`` is a device guard, ``Stream(device=...)``
    makes a stream on a device (the current one by default) and ``stream(s)`` switches to
    its device, as ``torch.cuda`` does. Every call that acts on a device is recorded in
    ``device_calls`` as ``(what, device_index)``: ``"device_guard"``, ``"Stream"``,
    ``"stream"``, ``"synchronize"``, ``"graph"`` (the current device when a capture
    begins, where ``torch.cuda.graph`` synchronizes and empties the cache),
    ``"graph_stream"`` (the capture stream's device), ``"CUDAGraph"``, ``"replay"`` and
    ``"reset"`` (the current device then). A backend given ``device="cuda:1"`` and this
    module can thus be checked to act on device 1 only while device 0 is current
    (:func:`cuda_graph_runner.testing.device_check.check_device_calls`).
    """

    def __init__(self, current_device: int = 0) -> None:
        self.events: List[Event] = []
        self.pool_handle = ("fake-pool", id(self))
        self.capturing: Optional[Any] = None  # a FakeGraph, or a subclass module's own graph type
        self.current = current_device
        self.device_calls: List[Tuple[str, Optional[int]]] = []
        # A class per module, as torch.cuda.Stream is a class (``Stream(device=...)``).
        self.Stream = type("Stream", (FakeStream,), {"module": self})  # type: ignore[assignment]  # a FakeStream subclass

    # devices
    def index_of(self, device: Any) -> int:
        """The index ``device`` names (an int, ``"cuda:1"``, a ``torch.device``); the
        current device for None or an index-less device."""
        if device is None:
            return self.current
        if isinstance(device, int):
            return device
        index = torch.device(device).index
        return self.current if index is None else index

    def record_device(self, what: str, index: Optional[int]) -> None:
        self.device_calls.append((what, self.current if index is None else index))

    def current_device(self) -> int:
        return self.current

    @contextlib.contextmanager
    def device(self, device: Any) -> Iterator[None]:
        index = self.index_of(device)
        self.record_device("device_guard", index)
        previous, self.current = self.current, index
        try:
            yield
        finally:
            self.current = previous

    def foreign_device_calls(self, index: int) -> List[Tuple[str, Optional[int]]]:
        """The recorded device calls that acted on another device than ``index``."""
        return [c for c in self.device_calls if c[1] != index]

    # graph API
    def CUDAGraph(self) -> FakeGraph:  # noqa: N802 - mirrors torch.cuda
        return FakeGraph(self)

    NPUGraph = CUDAGraph

    def graph_pool_handle(self) -> Any:
        self.events.append(("graph_pool_handle",))
        return self.pool_handle

    @contextlib.contextmanager
    def graph(self, cuda_graph: Any, pool: Any = None, stream: Any = None, **kwargs: Any) -> Iterator[None]:
        """``torch.cuda.graph``: records the capture; what runs inside it is recorded
        by :meth:`capture_recorder` (nothing here: a fake graph's replay is a no-op)."""
        if self.capturing is not None:
            raise RuntimeError("nested graph capture")
        self.record_device("graph", None)
        if stream is not None:
            self.record_device("graph_stream", getattr(stream, "device_index", None))
        with recording_capture(self, cuda_graph, ("capture_begin", cuda_graph.id, pool, stream)):
            with self.capture_recorder(cuda_graph):
                yield

    def capture_recorder(self, cuda_graph: Any) -> ContextManager[Any]:
        """The context that records the ops a capture runs into ``cuda_graph``: none
        here; a subclass whose graphs replay for real records them."""
        return contextlib.nullcontext()

    # streams and sync
    Stream = FakeStream  # replaced per instance by a subclass bound to the module

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        index = getattr(stream, "device_index", None)
        self.record_device("stream", index)
        # torch.cuda.stream(s) makes s's device current for the block.
        previous = self.current
        if index is not None:
            self.current = index
        try:
            yield
        finally:
            self.current = previous

    def synchronize(self, device: Any = None) -> None:
        self.record_device("synchronize", self.index_of(device))
        self.events.append(("synchronize",))

    def names(self) -> List[str]:
        """Event names only, in order."""
        return [e[0] for e in self.events]


class RecordingBackend(BaseCudaGraphBackend):
    """A CPU backend that records calls and emulates replay by re-running the forward.

    ``events`` holds ``("warmup", key)``, ``("post_warmup_hook", key)``,
    ``("capture", key)``, ``("replay", key)``, ``("cleanup",)`` in call order.

    Args (beyond :class:`~cuda_graph_runner.backend.BaseCudaGraphBackend`'s):
        share_pool: emulate one graph memory pool: the ``i``-th output tensor of every
            shape is a view of one buffer (sized by the largest shape, captured first),
            as real graphs of one pool reuse the blocks a larger shape freed. A replay
            then overwrites what earlier replays of *other* shapes returned, which is the
            output-lifetime contract at its strictest (a kept zero-copy output changes).
            False: each shape keeps its own tensors (only replays of the same shape
            overwrite them).
    """

    name = "recording"

    def __init__(self, device: Any = "cpu", *, share_pool: bool = False, **kwargs: Any) -> None:
        super().__init__(device, **kwargs)
        self.events: List[Event] = []
        self._fns: Dict[ShapeKey, ForwardFn] = {}
        self._outputs: Dict[ShapeKey, Any] = {}
        self.in_session = False
        self.share_pool = share_pool
        self._pool: Dict[Tuple[int, torch.dtype], torch.Tensor] = {}

    @contextlib.contextmanager
    def capture_session(self, stream: Any) -> Iterator[None]:
        self.in_session = True
        self.events.append(("session_begin",))
        try:
            yield
        finally:
            self.in_session = False
            self.events.append(("session_end",))

    def capture_one(
        self, key: ShapeKey, forward_fn: ForwardFn, *, post_warmup_hook: Optional[Callable[[], None]] = None
    ) -> None:
        if not self.in_session:
            raise RuntimeError("capture_one outside capture_session")
        runs = self.warmup_runs(key)  # the ``warmup`` policy, as real backends follow it
        for _ in range(runs):
            self.events.append(("warmup", key))
            forward_fn()
        if runs and post_warmup_hook is not None:
            self.events.append(("post_warmup_hook", key))
            post_warmup_hook()
        self.events.append(("capture", key))
        output = forward_fn()
        self._outputs[key] = self._place_in_pool(output) if self.share_pool else output
        self._fns[key] = forward_fn

    def _place_in_pool(self, output: Any) -> Any:
        counter = itertools.count()

        def place(t: torch.Tensor) -> torch.Tensor:
            slot_key = (next(counter), t.dtype)
            slot = self._pool.get(slot_key)
            if slot is None or slot.numel() < t.numel():
                slot = self._pool[slot_key] = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
            view = slot[: t.numel()].view(t.shape)
            view.copy_(t)
            return view

        return map_tensors(place, output)

    def can_run(self, batch: ForwardBatch, key: ShapeKey) -> bool:
        return key in self._fns

    def replay(self, key: ShapeKey, static_batch: ForwardBatch) -> Any:
        if key not in self._fns:
            raise KeyError(f"no graph captured for {key}")
        self.events.append(("replay", key))
        # Inside a runner, the forward on the live static batch (the capture plan's): the
        # captured ``forward_fn`` is bound to the capture-time batch. Outside one (tests
        # driving the backend by hand), the captured closure.
        plan = self.capture_plan
        with torch.no_grad():  # a graph replay records no autograd history
            fresh = plan.forward(static_batch) if plan is not None else self._fns[key]()
            copy_into(self._outputs[key], fresh)
        return self._outputs[key]

    def discard(self, key: ShapeKey) -> None:
        self.events.append(("discard", key))
        self._fns.pop(key, None)
        self._outputs.pop(key, None)

    def cleanup(self) -> None:
        self.events.append(("cleanup",))
        self._fns.clear()
        self._outputs.clear()
        self._pool.clear()

    def captured(self) -> List[ShapeKey]:
        """Keys in capture order."""
        return [e[1] for e in self.events if e[0] == "capture"]


class CountingCompiler:
    """A Dynamo backend for CPU tests of compiling backends: counts the graphs Dynamo
    hands it (``graphs``) and the calls of the compiled graphs (``calls``), and runs each
    graph as traced (no code generation, so a test compiles in milliseconds)."""

    def __init__(self) -> None:
        self.graphs = 0
        self.calls = 0

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        self.graphs += 1

        def run(*args: Any) -> Any:
            self.calls += 1
            return gm.forward(*args)

        return run
