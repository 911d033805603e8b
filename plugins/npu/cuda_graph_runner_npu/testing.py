"""Test doubles of torch_npu's graph API (``torch.npu.NPUGraph``, ``graph``, ...).

Both mirror the parameter names of torch_npu's ``torch_npu/npu/graphs.py``
(``graph(npu_graph, pool=None, stream=None, auto_dispatch_capture=False,
capture_error_mode="global")``, ``NPUGraph.update(cpu_update_input)``), including the
rule that ``update`` raises on a graph captured without ``auto_dispatch_capture=True``.
Pass either as ``device_module=`` to :class:`~cuda_graph_runner_npu.backend.NPUCudaGraphBackend`.

* :class:`RecordingNPUModule`: no device at all; records every call in ``events`` so a
  CPU test can check capture order, warm-ups, hooks, update-then-replay ordering and
  failure handling. Replay computes nothing.
* :class:`CudaBackedNPUModule`: the same API on top of ``torch.cuda`` CUDA graphs, so the
  plugin's own capture and replay code runs a real model on a GPU. Its ``update`` writes
  the host values into the static device buffers they stand for (``bind``), which is
  what torch_npu's update achieves for the attention op that reads them.

Neither imports torch_npu.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from typing import Any, ContextManager, Dict, Iterator, List, Optional, Tuple

import torch

from cuda_graph_runner.backend import graph_owned_cublas_workspace
from cuda_graph_runner.testing.fakes import recording_capture

Event = Tuple[Any, ...]

_NOT_UPDATABLE = (
    "The current graph configuration does not support update, "
    "Try to capture by setting auto_dispatch_capture=True during capture"
)


# ------------------------------------------------------------------------ recording fake


class RecordingNPUGraph:
    """A recording stand-in for ``torch_npu.npu.NPUGraph``.

    Each :class:`RecordingNPUModule` makes its own subclass bound to itself
    (``module.NPUGraph``), so ``NPUGraph()`` takes no argument, as in torch_npu.
    """

    _ids = itertools.count()
    module: "RecordingNPUModule"

    def __init__(self) -> None:
        self.id = next(self._ids)
        self.captured = False
        # Set by graph(), as torch_npu's graph.__init__ does.
        self.auto_dispatch_capture = False
        self.module.graphs.append(self)

    def update(self, cpu_update_input: List[Dict[str, Any]]) -> None:
        m = self.module
        m.events.append(("update_begin", self.id, cpu_update_input, threading.get_ident()))
        if not self.auto_dispatch_capture:
            raise RuntimeError(_NOT_UPDATABLE)
        if m.update_delay_s:
            time.sleep(m.update_delay_s)  # a replay issued concurrently would land in between
        if m.update_error is not None:
            raise m.update_error
        m.events.append(("update_end", self.id, threading.get_ident()))

    def replay(self) -> None:
        if not self.captured:
            raise RuntimeError("replay of a graph that was never captured")
        self.module.events.append(("replay", self.id, threading.get_ident()))

    def reset(self) -> None:
        self.captured = False
        self.module.events.append(("reset", self.id))

    def pool(self) -> Any:
        return self.module.pool_handle


class _NPUGraphContext:
    """``torch.npu.graph`` with torch_npu's parameter names (the backend's API check
    inspects them), shared by both doubles; each captures in its own ``_capture``."""

    def graph(
        self,
        npu_graph: Any,
        pool: Any = None,
        stream: Any = None,
        auto_dispatch_capture: bool = False,
        capture_error_mode: str = "global",
    ) -> ContextManager[Any]:
        """A context that captures into ``npu_graph``; ``update`` works on it only with
        ``auto_dispatch_capture=True`` (torch_npu's rule)."""
        npu_graph.auto_dispatch_capture = auto_dispatch_capture
        return self._capture(npu_graph, pool, stream, auto_dispatch_capture, capture_error_mode)

    def _capture(
        self, npu_graph: Any, pool: Any, stream: Any, auto_dispatch_capture: bool, capture_error_mode: str
    ) -> ContextManager[Any]:
        raise NotImplementedError


class RecordingNPUModule(_NPUGraphContext):
    """Records the ``torch.npu`` graph calls a backend makes, for CPU tests.

    Attributes:
        events: ``("graph_pool_handle",)``, ``("synchronize",)``, ``("stream", s)``,
            ``("capture_begin", graph_id, pool, stream, auto_dispatch_capture,
            capture_error_mode)``, ``("capture_end", graph_id)``,
            ``("update_begin", graph_id, cpu_update_input, thread)``,
            ``("update_end", graph_id, thread)``, ``("replay", graph_id, thread)``,
            ``("reset", graph_id)``, in call order. Tests may append their own.
        update_error: raised by every ``update`` (after ``update_begin``) while set.
        update_delay_s: ``update`` sleeps this long before finishing.
    """

    def __init__(self) -> None:
        self.events: List[Event] = []
        self.pool_handle = ("fake-npu-pool", id(self))
        self.capturing: Optional[RecordingNPUGraph] = None
        self.update_error: Optional[BaseException] = None
        self.update_delay_s: float = 0.0
        self.graphs: List[RecordingNPUGraph] = []
        # A class, as torch.npu.NPUGraph is (the API check inspects its methods).
        self.NPUGraph = type("NPUGraph", (RecordingNPUGraph,), {"module": self})

    def graph_pool_handle(self) -> Any:
        self.events.append(("graph_pool_handle",))
        return self.pool_handle

    def _capture(
        self, npu_graph: Any, pool: Any, stream: Any, auto_dispatch_capture: bool, capture_error_mode: str
    ) -> ContextManager[Any]:
        begin = ("capture_begin", npu_graph.id, pool, stream, auto_dispatch_capture, capture_error_mode)
        return recording_capture(self, npu_graph, begin)

    class Stream:
        def __repr__(self) -> str:
            return "FakeNPUStream"

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        self.events.append(("stream", stream))
        yield

    def synchronize(self, device: Any = None) -> None:
        self.events.append(("synchronize",))

    def names(self, *keep: str) -> List[str]:
        """Event names in order (only those in ``keep`` when given)."""
        return [e[0] for e in self.events if not keep or e[0] in keep]


# ------------------------------------------------------------------- CUDA-backed adapter


class CudaBackedNPUGraph:
    """``NPUGraph`` semantics on a ``torch.cuda.CUDAGraph`` (made through
    ``CudaBackedNPUModule().NPUGraph()``, a subclass bound to that module).

    Attributes:
        cuda_graph: the underlying CUDA graph.
        auto_dispatch_capture: set by :meth:`CudaBackedNPUModule.graph`.
        replays, updates: counts, for tests.
    """

    module: "CudaBackedNPUModule"

    def __init__(self) -> None:
        self.cuda_graph = torch.cuda.CUDAGraph()
        self.auto_dispatch_capture = False
        self.replays = 0
        self.updates = 0
        self.module.graphs.append(self)

    def update(self, cpu_update_input: List[Dict[str, Any]]) -> None:
        """Write each ``{name: host values}`` into the device buffer bound to ``name``.

        Issued on the current stream, so a replay issued afterwards on that stream
        reads the new values (torch_npu orders its update stream with an event).

        Raises:
            RuntimeError: the graph was captured without ``auto_dispatch_capture=True``
                (as torch_npu), ``update_error`` is set, or a name is not bound.
        """
        if not self.auto_dispatch_capture:
            raise RuntimeError(_NOT_UPDATABLE)
        if self.module.update_error is not None:
            raise self.module.update_error
        for entry in cpu_update_input:
            for name, values in entry.items():
                buf = self.module.bindings.get(name)
                if buf is None:
                    raise RuntimeError(
                        f"no device buffer bound to update input {name!r}; bound: {sorted(self.module.bindings)}"
                    )
                host = torch.as_tensor(values, dtype=buf.dtype)
                if host.numel() > buf.numel():
                    raise RuntimeError(f"update input {name!r} has {host.numel()} values for a buffer of {buf.numel()}")
                buf[: host.numel()].copy_(host)
        self.updates += 1

    def replay(self) -> None:
        self.cuda_graph.replay()
        self.replays += 1

    def reset(self) -> None:
        self.cuda_graph.reset()

    def pool(self) -> Any:
        return self.cuda_graph.pool()


class CudaBackedNPUModule(_NPUGraphContext):
    """``torch.npu``'s graph API (``NPUGraph``, ``graph``, ``graph_pool_handle``,
    ``Stream``, ``stream``, ``synchronize``) implemented with ``torch.cuda``.

    Anything else (``current_device``, ``memory_reserved``, ...) is forwarded to
    ``torch.cuda``.

    Attributes:
        bindings: update-input name -> the static device tensor it stands for
            (see :meth:`bind`).
        update_error: raised by every ``update`` while set.
        graphs: every graph made, in order.
    """

    def __init__(self) -> None:
        self.bindings: Dict[str, torch.Tensor] = {}
        self.update_error: Optional[BaseException] = None
        self.graphs: List[CudaBackedNPUGraph] = []
        self.Stream = torch.cuda.Stream
        self.stream = torch.cuda.stream
        self.synchronize = torch.cuda.synchronize
        self.graph_pool_handle = torch.cuda.graph_pool_handle
        self.NPUGraph = type("NPUGraph", (CudaBackedNPUGraph,), {"module": self})

    def bind(self, name: str, buffer: torch.Tensor) -> None:
        """Make ``update`` inputs called ``name`` write into ``buffer`` (a 1-D device tensor)."""
        self.bindings[name] = buffer

    def _capture(
        self, npu_graph: Any, pool: Any, stream: Any, auto_dispatch_capture: bool, capture_error_mode: str
    ) -> ContextManager[Any]:
        return graph_owned_cublas_workspace(
            torch.cuda.graph(npu_graph.cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode),
            torch.cuda,
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)
