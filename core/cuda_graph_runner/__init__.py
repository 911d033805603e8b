"""cuda-graph-runner: capture an LLM's forward pass as device graphs and replay them per batch.

The names most users need are importable from here; each is loaded on first use, so
``import cuda_graph_runner`` stays cheap and does not import torch (the config and the
registry's discovery work without it).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "CudaGraphConfig": "config",
    "PhaseConfig": "config",
    "Phase": "config",
    "Backend": "config",
    "CudaGraphConfigError": "config",
    "BaseCudaGraphBackend": "backend",
    "ShapeKey": "backend",
    "ForwardBatch": "forward_batch",
    "ForwardMode": "forward_batch",
    "forward_context": "forward_context",
    "get_forward_batch": "forward_context",
    "eager_op": "graph_break",
    "BackendSpec": "hookspecs",
    "DefaultClaim": "hookspecs",
    "hookimpl": "hookspecs",
    "list_backends": "registry",
    "register": "registry",
    "resolve_decode_backend": "registry",
    "resolve_prefill_backend": "registry",
    "BaseCudaGraphRunner": "runner",
    "DecodeCudaGraphRunner": "runner",
    "PrefillCudaGraphRunner": "runner",
    "estimate_graph_memory": "memory_estimate",
    "StaleWeightsError": "weights",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cuda_graph_runner' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
