"""A CPU stand-in for device graphs that really replays what it recorded (a test double).

:class:`EmulatedGraphDeviceModule` extends the core's recording fake
(:class:`cuda_graph_runner.testing.fakes.FakeGraphDeviceModule`) so that a "capture"
records every aten op run inside it (a ``TorchDispatchMode``) and a "replay" re-runs
those ops on the *same tensor objects*, copying each freshly produced result into the
tensor the capture produced. That is what a CUDA graph does with addresses:

* inputs are read from the tensors the capture saw (static buffers), so a runner that
  forgets to copy a live value into them replays stale values, as on a GPU;
* host values are frozen: a tensor made from a Python list inside a capture replays the
  capture-time values, and a marked op captured *inside* a graph replays the aten ops
  it ran at capture, with the capture-time metadata (the classic stale-metadata bug);
* host syncs (``.item()``, ``nonzero``) inside a capture raise, as CUDA capture does.

It does not emulate the memory pool (every recorded tensor stays alive), streams or
kernel timing. Used by the breakable plugin's CPU tests.
"""

from __future__ import annotations

import itertools
from typing import Any, ContextManager, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from cuda_graph_runner.backend import NAMESPACE, CudaGraphRunnerError, registered_eager_ops
from cuda_graph_runner.testing.fakes import FakeGraphDeviceModule

__all__ = ["EmulatedGraph", "EmulatedGraphDeviceModule", "HostSyncInCaptureError"]

_ids = itertools.count(10_000)


class HostSyncInCaptureError(CudaGraphRunnerError, RuntimeError):
    """An op that needs the host to read device values ran inside an emulated capture."""


_HOST_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "equal", "is_nonzero", "item"}


def _storage_key(t: torch.Tensor) -> Optional[int]:
    if t.numel() == 0:
        return None
    return t.untyped_storage().data_ptr()


class _Recorded:
    __slots__ = ("func", "args", "kwargs", "fresh")

    def __init__(self, func: Any, args: tuple, kwargs: dict, fresh: List[Optional[torch.Tensor]]) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        # Per flattened output: the capture's tensor when it is freshly allocated (the
        # replay copies into it), None when it aliases an input (views, in-place, out=).
        self.fresh = fresh


class EmulatedGraph:
    """A recorded op sequence; ``replay()`` re-runs it. Mirrors ``torch.cuda.CUDAGraph``."""

    def __init__(self, module: "EmulatedGraphDeviceModule") -> None:
        self.module = module
        self.id = next(_ids)
        self.captured = False
        self.ops: List[_Recorded] = []

    def replay(self) -> None:
        if not self.captured:
            raise RuntimeError("replay of a graph that was never captured")
        self.module.events.append(("replay", self.id))
        with torch.no_grad():
            for rec in self.ops:
                result = rec.func(*rec.args, **rec.kwargs)
                new, _ = tree_flatten(result)
                for leaf in new:
                    # A collective (c10d op) returns its Work: waited here, as a device
                    # stream orders a recorded collective before the ops after it.
                    if not isinstance(leaf, torch.Tensor) and hasattr(leaf, "wait"):
                        leaf.wait()
                for dst, src in zip(rec.fresh, new):
                    if dst is not None:
                        dst.copy_(src)

    def reset(self) -> None:
        self.captured = False
        self.ops = []
        self.module.events.append(("reset", self.id))

    def pool(self) -> Any:
        return self.module.pool_handle


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: EmulatedGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        name = func.name()
        base = name.split("::")[-1].split(".")[0]
        if func.namespace == "aten" and base in _HOST_SYNC_OPS:
            raise HostSyncInCaptureError(
                f"{name} reads device values on the host; it is not allowed inside a graph capture"
            )
        if func.namespace == NAMESPACE:
            # A marked op captured *into* a graph: record the ops its body runs, with
            # the metadata of this moment, as a CUDA capture would.
            op = registered_eager_ops().get(base)
            if op is not None:
                with self:
                    return op.fn(*args, **kwargs)
        out = func(*args, **kwargs)
        inputs = {
            k
            for k in (_storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
            if k is not None
        }
        flat, _ = tree_flatten(out)
        fresh = [
            t if isinstance(t, torch.Tensor) and _storage_key(t) not in inputs and t.numel() else None for t in flat
        ]
        self.graph.ops.append(_Recorded(func, args, kwargs, fresh))
        return out


class EmulatedGraphDeviceModule(FakeGraphDeviceModule):
    """``torch.cuda``'s graph API on the CPU, with real replay (see the module docstring).

    ``events`` records ``capture_begin``/``capture_end``/``replay``/``reset`` like the
    core fake; tests append their own events (e.g. from a marked op) to the same list to
    check the order of segments and eager ops.
    """

    def CUDAGraph(self) -> EmulatedGraph:  # type: ignore[override]  # noqa: N802 - mirrors torch.cuda; its own graph type
        return EmulatedGraph(self)

    def capture_recorder(self, cuda_graph: EmulatedGraph) -> ContextManager[Any]:
        """Records the ops a capture runs, for :meth:`EmulatedGraph.replay` to re-run."""
        return _Recorder(cuda_graph)

    def is_current_stream_capturing(self) -> bool:
        return self.capturing is not None

    def segment_order(self) -> List[Tuple[Any, ...]]:
        """Events after the last capture, i.e. what replays did, in order."""
        last = max((i for i, e in enumerate(self.events) if e[0] == "capture_end"), default=-1)
        return self.events[last + 1 :]
