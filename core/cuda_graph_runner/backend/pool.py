"""One graph memory pool and one capture stream per device, shared by every runner.

Decode and prefill never replay at the same time, so sharing one pool reserves only
the larger phase's footprint (sglang stage C, ``runner_utils/pool.py``); capturing the
largest size first lets each smaller graph reuse the blocks of the larger ones.

On CUDA the pool is a ``torch.cuda.MemPool`` held here, not a bare
``graph_pool_handle()``: the caching allocator forgets a bare handle's pool when its last
graph is destroyed, and a capture into that handle while a tensor of the pool is still
alive (an output a caller kept, a runner cleaned up and captured again) fails with
``INTERNAL ASSERT FAILED ... use_count > 0``. The ``MemPool`` keeps one reference, so the
pool lives until :func:`release_unused_graph_memory_pool` finds no graph using it.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Dict, Iterator, Optional

import torch

from .device import new_stream, resolve_device

_pools: Dict[Any, Any] = {}
#: The ``torch.cuda.MemPool`` behind each CUDA pool handle in ``_pools`` (keeps it alive).
_mem_pools: Dict[Any, Any] = {}
_streams: Dict[Any, Any] = {}


def _device_key(device: "torch.device | str", module: Optional[Any] = None) -> Any:
    # "cuda" and "cuda:0" must name the same pool: resolve a missing index to the current device.
    key = str(resolve_device(device, module))
    if module is None:
        return key
    try:
        native = torch.get_device_module(torch.device(key))
    except Exception:  # a device type this torch cannot name: only the given module knows it
        native = None
    # A test fake passed as the module must never share (or poison) the real device's cache.
    return key if module is native else (key, module)


def get_global_graph_memory_pool(device: "torch.device | str", device_module: Optional[Any] = None) -> Any:
    """The process-wide graph pool handle of ``device`` (``device_module.graph_pool_handle()``).

    Raises:
        RuntimeError: the device module has no graph pools (the CPU).
    """
    key = _device_key(device, device_module)
    if key not in _pools:
        module = device_module or torch.get_device_module(torch.device(device))
        if not hasattr(module, "graph_pool_handle"):
            raise RuntimeError(f"device {key!r} has no graph memory pool ({module.__name__} lacks graph_pool_handle)")
        mem_pool_cls = getattr(module, "MemPool", None) if module is getattr(torch, "cuda", None) else None
        if mem_pool_cls is not None:
            # MemPool() makes its pool on the *current* device: make it on this one.
            with module.device(resolve_device(device, module)):
                mem_pool = mem_pool_cls()
            _mem_pools[key] = mem_pool
            _pools[key] = mem_pool.id
        else:
            _pools[key] = module.graph_pool_handle()
    return _pools[key]


def release_unused_graph_memory_pool(device: "torch.device | str", device_module: Optional[Any] = None) -> bool:
    """Give the pool of ``device`` back when no graph uses it any more (after every runner
    using it was cleaned up): its cached blocks go back to the allocator and the next
    capture gets a fresh pool. Tensors of the old pool that are still referenced stay valid.

    Returns:
        True if the pool was released; False if a graph still uses it, there is none, or
        the device cannot tell (no ``MemPool.use_count``).
    """
    key = _device_key(device, device_module)
    mem_pool = _mem_pools.get(key)
    use_count = getattr(mem_pool, "use_count", None)
    if use_count is None or use_count() > 1:  # 1: only our own reference is left
        return False
    del _mem_pools[key], _pools[key]
    return True


def get_capture_stream(device: "torch.device | str", device_module: Optional[Any] = None) -> Any:
    """The process-wide side stream captures run on, or None on a device without streams.

    The stream is made *on* ``device`` (``Stream(device=...)``), not on the current
    device: a capture stream of another device records none of the model's kernels.
    """
    if torch.device(device).type == "cpu":
        return None
    key = _device_key(device, device_module)
    if key not in _streams:
        stream = new_stream(resolve_device(device, device_module), device_module)
        if stream is None:
            return None
        _streams[key] = stream
    return _streams[key]


def pool_memory_bytes(pool: Any, device: "torch.device | str" = "cuda") -> Optional[int]:
    """Bytes the caching allocator holds in graph pool ``pool`` (all its segments), or None
    where the device cannot tell (not CUDA).

    Read from the allocator's snapshot (``torch.cuda.memory._snapshot``), which tags each
    segment with the pool it belongs to; the reserved-memory delta around a capture is no
    measure, since ``torch.cuda.graph`` empties the cache when it starts.
    """
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        segments = torch.cuda.memory._snapshot()["segments"]
    except Exception:  # a private API: never let a measurement break capture
        return None
    want = tuple(pool) if isinstance(pool, (tuple, list)) else pool
    index = torch.device(device).index
    return sum(
        s["total_size"]
        for s in segments
        if tuple(s.get("segment_pool_id", ())) == want and (index is None or s.get("device", index) == index)
    )


def reset_global_graph_memory_pools() -> None:
    """Forget every pool and stream (after every graph using them was cleaned up)."""
    _pools.clear()
    _mem_pools.clear()
    _streams.clear()


def clear_cublas_workspaces() -> None:
    """Drop the cuBLAS (and cuBLASLt) workspaces cached per handle and stream
    (``torch._C._cuda_clearCublasWorkspaces``); a no-op where torch has no CUDA."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


@contextlib.contextmanager
def _graph_owned_cublas_workspace(ctx: ContextManager[Any]) -> Iterator[None]:
    clear_cublas_workspaces()
    try:
        with ctx:
            yield
    finally:
        clear_cublas_workspaces()


def graph_owned_cublas_workspace(ctx: ContextManager[Any], device_module: Any) -> ContextManager[Any]:
    """Wrap a ``torch.cuda.graph(...)`` context so the graph's cuBLAS workspace lives in
    the graph's own memory pool; other device modules get ``ctx`` unchanged.

    cuBLAS keeps one workspace per (handle, stream), allocated from the general cache by
    the first GEMM on the stream (a warm-up), and a captured GEMM records its raw
    address. Whoever then drops those workspaces (``torch.compile(mode="reduce-overhead")``
    does at every CUDA-graph-tree recording) frees memory the graph still writes at each
    replay: after ``empty_cache()`` the replay faults (illegal memory access), otherwise
    it scribbles on whatever tensor got the block next. Dropping the cached workspaces
    right before the capture makes the captured GEMMs allocate theirs inside the pool
    (alive while the pool is); dropping them again after it keeps later eager GEMMs out
    of the pool. Source: PyTorch's CUDA-graph trees (``clear_cublas_manager`` in
    ``torch/_inductor/cudagraph_trees.py``) and pytorch/pytorch#192061 / #193402.

    The drop is process-wide, as the trees' is: every cached workspace, every stream and
    device. A graph the embedding engine captured itself with a workspace from the general
    cache is then exposed exactly as ours were; capture such graphs inside this context
    too (pass ``torch.cuda``), and never capture from two threads at once.
    """
    if device_module is not getattr(torch, "cuda", None):
        return ctx
    return _graph_owned_cublas_workspace(ctx)
