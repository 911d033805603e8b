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

from typing import Any, Dict, Optional

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
