"""What a capture did and what it cost; the error a capture that runs out of memory raises.

Graph memory before committing: a runner captures the largest size first, and every
smaller graph reuses blocks the larger ones returned to the shared pool, so the pool's
size right after the largest size is most of the final size. An engine that sizes its
KV cache around the graphs can therefore do::

    runner.capture(sizes=[runner.max_size])     # the largest size only
    graph_bytes = runner.graph_memory_bytes()   # the pool so far (None: device cannot tell)
    ...                                         # size the KV cache around it
    runner.capture()                            # the remaining sizes, largest first

Accuracy (CUDA; the pool is measured from the caching allocator's snapshot): the
estimate is a *lower bound* of the final pool (a private pool releases nothing while
its graphs live). The remaining sizes add only what their graphs keep alive beyond the
largest's blocks (kernel workspaces, outputs a backend holds strongly). Measured on an
H200 (``docs/benchmarks.md``: Llama-3.2-1B and Qwen2.5-0.5B shapes, 36 decode sizes up
to 256): final pool = the largest size alone (ratio 1.00) for full, breakable and
tc_piecewise. Documented bound: ``final <= 1.5 * estimate + 64 MiB``
(:data:`ESTIMATE_FACTOR`, :data:`ESTIMATE_SLACK_BYTES`; checked on the GPU by
``tests/test_multi_device_gpu.py``). On devices that cannot tell (NPU, fakes) the
estimate is None unless the backend reports its own ``graph_memory_bytes``; the pool is
shared, so capture one runner at a time when measuring.

Before the KV cache exists, :func:`cuda_graph_runner.runner.memory_estimate.estimate_graph_memory`
measures the whole capture (every size, both phases) against the smallest cache of the
engine's dimensions instead.

Idea: sglang captures largest first into one pool for the same reason and reports the
memory a capture took ("Capture cuda graph end ... mem usage"); vLLM profiles graph
memory before sizing the KV cache (``profile_run`` / ``cudagraph_memory_estimate``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence

import torch

from ..backend.errors import CudaGraphRunnerError

#: Documented accuracy of the estimate after the largest size:
#: ``final_pool_bytes <= ESTIMATE_FACTOR * estimate + ESTIMATE_SLACK_BYTES``.
ESTIMATE_FACTOR = 1.5
ESTIMATE_SLACK_BYTES = 64 * 2**20


@dataclasses.dataclass
class CaptureReport:
    """What one ``runner.capture()`` call did.

    Attributes:
        phase, backend: the runner's phase and backend name.
        sizes: sizes captured by this call, in capture order (largest first).
        captured_sizes: every size the runner holds a graph for now, descending.
        seconds: wall time of the call (compile pass of ``prepare`` included).
        first_size_pool_bytes: pool bytes right after this call's first (largest) size:
            the estimate of the graph memory (see the module docstring); None where the
            device cannot tell or nothing was captured.
        pool_bytes: pool bytes after the call (the pool is shared: other runners' graphs
            in it count too); None where the device cannot tell.
        compile_seconds: the part of ``seconds`` the backend spent compiling (its
            ``compile_seconds``: tc_piecewise's compile pass, compiled's first call per
            size); None for a backend that does not compile.
    """

    phase: str
    backend: str
    sizes: List[int]
    captured_sizes: List[int]
    seconds: float
    first_size_pool_bytes: Optional[int] = None
    pool_bytes: Optional[int] = None
    compile_seconds: Optional[float] = None

    @property
    def graph_capture_seconds(self) -> float:
        """``seconds`` less ``compile_seconds``: warm-ups and recording."""
        return max(0.0, self.seconds - (self.compile_seconds or 0.0))


def _oom_types() -> tuple:
    types = [
        t
        for t in (
            getattr(torch, "OutOfMemoryError", None),
            getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None),
        )
        if isinstance(t, type)
    ]
    return tuple(dict.fromkeys(types))


def find_out_of_memory(exc: Optional[BaseException]) -> Optional[BaseException]:
    """The out-of-memory error in ``exc``'s chain (``__cause__``/``__context__``), or None.

    Recognised: ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError``), and, for
    devices whose runtime raises a plain error (torch_npu's ``RuntimeError: NPU out of
    memory``), a ``RuntimeError``/``MemoryError`` whose message says "out of memory".
    A backend that wraps the error (tc_piecewise's piece errors) still counts.
    """
    types = _oom_types()
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, CaptureOutOfMemoryError):
            return None  # already explained
        if types and isinstance(exc, types):
            return exc
        if isinstance(exc, (RuntimeError, MemoryError)) and "out of memory" in str(exc).lower():
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _mib(n: Optional[int]) -> str:
    return "unknown on this device" if n is None else f"{n / 2**20:.1f} MiB ({n} bytes)"


_Base = _oom_types()[0] if _oom_types() else MemoryError


class CaptureOutOfMemoryError(CudaGraphRunnerError, _Base):  # type: ignore[misc,valid-type]
    """The device ran out of memory while a runner captured its graphs.

    A subclass of ``torch.OutOfMemoryError`` (so ``except torch.cuda.OutOfMemoryError``
    still catches it) and of :class:`~cuda_graph_runner.backend.errors.CudaGraphRunnerError`;
    the original error is chained (``__cause__``). The runner stays usable: the sizes
    captured before the error replay, every other batch runs eagerly, and
    ``cleanup()`` + ``capture()`` work.

    Attributes:
        phase, backend: the runner's phase and backend name.
        size: the size being captured (warm-up or recording) when memory ran out.
        captured_sizes: sizes that hold a graph, descending.
        pending_sizes: sizes that were still to capture (``size`` included), descending.
        pool_bytes: bytes of the graph pool so far (None: the device cannot tell).
        free_bytes, total_bytes: the device's free/total memory after the error, if known.
    """

    def __init__(
        self,
        *,
        phase: str,
        backend: str,
        size: int,
        captured_sizes: Sequence[int],
        pending_sizes: Sequence[int],
        pool_bytes: Optional[int],
        free_bytes: Optional[int] = None,
        total_bytes: Optional[int] = None,
        original: Optional[BaseException] = None,
    ) -> None:
        self.phase = phase
        self.backend = backend
        self.size = size
        self.captured_sizes = sorted(captured_sizes, reverse=True)
        self.pending_sizes = sorted(pending_sizes, reverse=True)
        self.pool_bytes = pool_bytes
        self.free_bytes = free_bytes
        self.total_bytes = total_bytes
        smaller = [s for s in self.captured_sizes + self.pending_sizes if s < size]
        hint_max = max(smaller) if smaller else None
        free = (
            ""
            if free_bytes is None
            else f"; device memory free now: {_mib(free_bytes)}"
            + ("" if total_bytes is None else f" of {_mib(total_bytes)}")
        )
        first = str(original).strip().splitlines()[0] if original is not None and str(original).strip() else ""
        message = (
            f"out of memory capturing the {phase} graphs with backend {backend!r} at size {size}; "
            f"sizes captured so far: {self.captured_sizes or 'none'}; not captured: {self.pending_sizes}; "
            f"graph memory pool so far: {_mib(pool_bytes)}{free}. The runner still serves: captured sizes "
            f"replay, other batches run eagerly. Fixes: capture fewer or smaller graphs — a smaller "
            f"{phase} max_bs" + (f" (e.g. {hint_max})" if hint_max else "") + f" or a shorter size list ({phase} bs) — "
            f"or leave more device memory free before capture (a smaller KV cache / memory fraction, "
            f"fewer other tensors or processes on the device)." + (f" Original error: {first}" if first else "")
        )
        super().__init__(message)

    def __reduce__(self) -> Any:  # keep pickling (multiprocessing) working with keyword-only args
        return (_rebuild, (self.args[0],))

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _rebuild(message: str) -> BaseException:
    err = CaptureOutOfMemoryError.__new__(CaptureOutOfMemoryError)
    err.args = (message,)
    return err


def device_memory_info(device: torch.device, device_module: Any) -> tuple:
    """``(free_bytes, total_bytes)`` of ``device`` from ``device_module.mem_get_info``, or
    ``(None, None)`` where it cannot tell (never raises)."""
    info = getattr(device_module, "mem_get_info", None)
    if info is None or device.type == "cpu":
        return None, None
    try:
        free, total = info(device)
        return int(free), int(total)
    except Exception:
        return None, None
