"""Node and kernel counts of a captured CUDA graph, for ``runner.describe()``.

``torch.cuda.CUDAGraph`` has no node count of its own in torch 2.11 or 2.13. What both
offer (``keep_graph``, ``raw_cuda_graph`` and ``instantiate`` are documented from torch
2.8; read in the 2.13 source here, and ``tests/test_inspect_gpu.py`` checks the counts
with the H200's 2.11; a torch without ``keep_graph`` gives None; torch's development
branch adds ``CUDAGraph.get_graph_data()`` and post-instantiate hooks, not in 2.13):

* ``CUDAGraph(keep_graph=True)`` keeps the captured ``cudaGraph_t`` after capture
  (torch frees it once instantiated otherwise), and ``raw_cuda_graph()`` returns it;
* ``enable_debug_mode()`` before capture and ``debug_dump(path)`` after write a DOT file
  of the graph (a file per graph: too heavy to count from).

So the count needs the graph's template kept: the base backend captures with
``keep_graph=True`` and instantiates right after capture when asked
(``BaseCudaGraphBackend.keep_graph_templates`` or ``CUDA_GRAPH_RUNNER_GRAPH_NODES=1``;
``cuda-graph-runner inspect`` asks), so replays run as ever; the template costs host
memory per graph. The counting calls the CUDA runtime's ``cudaGraphGetNodes`` and
``cudaGraphNodeGetType`` through ``ctypes`` on the ``libcudart`` torch already loaded (by
soname, else by the path this process mapped).
Anything missing (no CUDA, a graph without its template, another graph type, no
runtime library) gives None: a count is optional and never breaks describe().
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Dict, List, Optional

#: ``cudaGraphNodeTypeKernel`` in the CUDA runtime's ``cudaGraphNodeType``.
_KERNEL_NODE = 0
_RUNTIME_NAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so", "cudart64_12.dll")
_runtime: Any = None


def _loaded_cudart_paths() -> List[str]:
    """Paths of the ``libcudart`` this process has mapped (Linux), which a bare soname
    may not reach when torch loaded it from its own wheel folder."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.isabs(p))


def _cudart() -> Optional[Any]:
    global _runtime
    if _runtime is None:
        _runtime = False
        for name in (*_RUNTIME_NAMES, *_loaded_cudart_paths()):
            try:
                _runtime = ctypes.CDLL(name)
                break
            except OSError:
                continue
    return _runtime or None


def graph_node_counts(graph: Any) -> Optional[Dict[str, int]]:
    """``{"nodes": n, "kernels": k}`` of a ``torch.cuda.CUDAGraph`` captured with
    ``keep_graph=True``, else None (see the module docstring for when torch can tell)."""
    raw = getattr(graph, "raw_cuda_graph", None)
    if raw is None:
        return None
    try:
        handle = raw()
    except Exception:  # captured without keep_graph: torch freed the template
        return None
    lib = _cudart()
    if lib is None or not handle:
        return None
    count = ctypes.c_size_t(0)
    graph_t = ctypes.c_void_p(handle)
    if lib.cudaGraphGetNodes(graph_t, None, ctypes.byref(count)) != 0:
        return None
    nodes = (ctypes.c_void_p * max(count.value, 1))()
    if lib.cudaGraphGetNodes(graph_t, nodes, ctypes.byref(count)) != 0:
        return None
    kernels = 0
    kind = ctypes.c_int(0)
    for i in range(count.value):
        if lib.cudaGraphNodeGetType(ctypes.c_void_p(nodes[i]), ctypes.byref(kind)) == 0 and kind.value == _KERNEL_NODE:
            kernels += 1
    return {"nodes": int(count.value), "kernels": kernels}
