"""The backend contract: everything a backend plugin imports, from this one package.

A plugin author needs only ``from cuda_graph_runner.backend import ...`` (and, in its tests,
:mod:`cuda_graph_runner.testing`). The names below are loaded on first use (PEP 562), so
``import cuda_graph_runner.backend`` imports no torch and registration modules stay light;
the modules of this package (:mod:`.base`, :mod:`.hookspecs`, :mod:`.capture_plan`, ...)
are the layer the registry and the runners build on. See docs/architecture.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config.exceptions import CudaGraphConfigError
    from .base import (
        BaseCudaGraphBackend,
        DisabledBackend,
        ForwardFn,
        ShapeKey,
        WarmupHook,
        compiled_verify_tolerance,
        default_verify_tolerance,
    )
    from .buffers import copy_into
    from .capture_plan import CapturePlan
    from .compile_cache import cache_counters, compile_cache_dir, compile_cache_scope, compile_key
    from .compile_cache_dynamo import precompile_paused
    from .context import forward_context, get_forward_batch
    from .errors import (
        BackendConflictError,
        BackendContractError,
        BackendLoadError,
        BackendUnavailableError,
        CompileCacheError,
        CudaGraphHostValueError,
        CudaGraphRunnerError,
        CudaGraphVerifyError,
        RegistryReentryError,
        UnknownBackendError,
    )
    from .forward_batch import ForwardBatch, ForwardMode, as_static_batch
    from .graph_break import (
        NAMESPACE,
        EagerOp,
        break_handler,
        breaks_refused,
        call_eagerly,
        capture_safe_now,
        eager_op,
        eager_op_for_target,
        is_eager_op_target,
        marked_op_bodies,
        refuse_breaks,
        register_eager_op,
        registered_eager_ops,
    )
    from .graph_nodes import graph_node_counts
    from .hookspecs import ENTRY_POINT_GROUP, PLUGIN_API_VERSION, BackendSpec, DefaultClaim, backend_hooks, hookimpl
    from .host_guard import SCOPE_FORWARD, host_value_guard, run_marked_op
    from .model_forward import entry_function, forward_as_written, forward_replaced, forward_wrappers
    from .nested import iter_tensors, map_pairs, map_tensors
    from .pool import get_capture_stream, graph_owned_cublas_workspace
    from .probes import cuda_graphs
    from .profiling import trace_ranges
    from .weak_ref import weak_ref_tensor, weak_ref_tensors

#: public name -> the module of this package (or the config) that defines it
_EXPORTS = {
    "BaseCudaGraphBackend": ".base",
    "DisabledBackend": ".base",
    "ForwardFn": ".base",
    "ShapeKey": ".base",
    "WarmupHook": ".base",
    "compiled_verify_tolerance": ".base",
    "default_verify_tolerance": ".base",
    "copy_into": ".buffers",
    "CapturePlan": ".capture_plan",
    "cache_counters": ".compile_cache",
    "compile_cache_dir": ".compile_cache",
    "compile_cache_scope": ".compile_cache",
    "compile_key": ".compile_cache",
    "precompile_paused": ".compile_cache_dynamo",
    "BackendConflictError": ".errors",
    "BackendContractError": ".errors",
    "BackendLoadError": ".errors",
    "BackendUnavailableError": ".errors",
    "CompileCacheError": ".errors",
    "CudaGraphHostValueError": ".errors",
    "CudaGraphRunnerError": ".errors",
    "CudaGraphVerifyError": ".errors",
    "RegistryReentryError": ".errors",
    "UnknownBackendError": ".errors",
    "ForwardBatch": ".forward_batch",
    "ForwardMode": ".forward_batch",
    "as_static_batch": ".forward_batch",
    "forward_context": ".context",
    "get_forward_batch": ".context",
    "NAMESPACE": ".graph_break",
    "EagerOp": ".graph_break",
    "break_handler": ".graph_break",
    "breaks_refused": ".graph_break",
    "call_eagerly": ".graph_break",
    "capture_safe_now": ".graph_break",
    "eager_op": ".graph_break",
    "eager_op_for_target": ".graph_break",
    "is_eager_op_target": ".graph_break",
    "marked_op_bodies": ".graph_break",
    "refuse_breaks": ".graph_break",
    "register_eager_op": ".graph_break",
    "registered_eager_ops": ".graph_break",
    "graph_node_counts": ".graph_nodes",
    "ENTRY_POINT_GROUP": ".hookspecs",
    "PLUGIN_API_VERSION": ".hookspecs",
    "BackendSpec": ".hookspecs",
    "DefaultClaim": ".hookspecs",
    "backend_hooks": ".hookspecs",
    "hookimpl": ".hookspecs",
    "SCOPE_FORWARD": ".host_guard",
    "host_value_guard": ".host_guard",
    "run_marked_op": ".host_guard",
    "entry_function": ".model_forward",
    "forward_as_written": ".model_forward",
    "forward_replaced": ".model_forward",
    "forward_wrappers": ".model_forward",
    "iter_tensors": ".nested",
    "map_pairs": ".nested",
    "map_tensors": ".nested",
    "get_capture_stream": ".pool",
    "graph_owned_cublas_workspace": ".pool",
    "cuda_graphs": ".probes",
    "trace_ranges": ".profiling",
    "weak_ref_tensor": ".weak_ref",
    "weak_ref_tensors": ".weak_ref",
    "CudaGraphConfigError": "..config.exceptions",
}

__all__ = [
    "BackendConflictError",
    "BackendContractError",
    "BackendLoadError",
    "BackendSpec",
    "BackendUnavailableError",
    "BaseCudaGraphBackend",
    "CapturePlan",
    "CompileCacheError",
    "CudaGraphConfigError",
    "CudaGraphHostValueError",
    "CudaGraphRunnerError",
    "CudaGraphVerifyError",
    "DefaultClaim",
    "DisabledBackend",
    "ENTRY_POINT_GROUP",
    "EagerOp",
    "ForwardBatch",
    "ForwardFn",
    "ForwardMode",
    "NAMESPACE",
    "PLUGIN_API_VERSION",
    "RegistryReentryError",
    "SCOPE_FORWARD",
    "ShapeKey",
    "UnknownBackendError",
    "WarmupHook",
    "as_static_batch",
    "backend_hooks",
    "break_handler",
    "breaks_refused",
    "cache_counters",
    "call_eagerly",
    "capture_safe_now",
    "compile_cache_dir",
    "compile_cache_scope",
    "compile_key",
    "compiled_verify_tolerance",
    "copy_into",
    "cuda_graphs",
    "default_verify_tolerance",
    "eager_op",
    "eager_op_for_target",
    "entry_function",
    "forward_as_written",
    "forward_context",
    "forward_replaced",
    "forward_wrappers",
    "get_capture_stream",
    "get_forward_batch",
    "graph_node_counts",
    "graph_owned_cublas_workspace",
    "hookimpl",
    "host_value_guard",
    "is_eager_op_target",
    "iter_tensors",
    "map_pairs",
    "map_tensors",
    "marked_op_bodies",
    "precompile_paused",
    "refuse_breaks",
    "register_eager_op",
    "registered_eager_ops",
    "run_marked_op",
    "trace_ranges",
    "weak_ref_tensor",
    "weak_ref_tensors",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
