"""cuda-graph-runner: capture an LLM's forward pass as device graphs and replay them per batch.

The names most users need are importable from here; each is loaded on first use, so
``import cuda_graph_runner`` stays cheap and does not import torch (the config and the
registry's discovery work without it).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any, Optional, Sequence

__version__ = "0.1.0"

_EXPORTS = {
    "CudaGraphConfig": "config",
    "PhaseConfig": "config",
    "Phase": "config",
    "Backend": "config",
    "CudaGraphConfigError": "config",
    "BaseCudaGraphBackend": "backend",
    "ShapeKey": "backend",
    "ForwardBatch": "backend",
    "ForwardMode": "backend",
    "forward_context": "backend",
    "get_forward_batch": "backend",
    "eager_op": "backend",
    "BackendSpec": "backend",
    "DefaultClaim": "backend",
    "hookimpl": "backend",
    "list_backends": "registry",
    "register": "registry",
    "resolve_decode_backend": "registry",
    "resolve_prefill_backend": "registry",
    "BaseCudaGraphRunner": "runner",
    "DecodeCudaGraphRunner": "runner",
    "PrefillCudaGraphRunner": "runner",
    "estimate_graph_memory": "runner.memory_estimate",
    "StaleWeightsError": "runner.weights",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cuda_graph_runner' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


# -- deprecated module paths ------------------------------------------------------------------
#: Deprecated module path (relative to this package) -> the module it names. Importing one
#: imports that module, binds it under the deprecated name too and warns once
#: (``DeprecationWarning``); no file exists at a deprecated path. See docs/architecture.md.
MOVED_MODULES = {
    "backend_options": "backend.options",
    "bench": "cli.bench.command",
    "bench_args": "cli.bench.args",
    "bench_backends": "cli.bench.backends",
    "bench_measure": "cli.bench.measure",
    "bench_output": "cli.bench.output",
    "bench_tp": "cli.bench.tp",
    "buffers": "backend.buffers",
    "capture_plan": "backend.capture_plan",
    "capture_report": "runner.capture_report",
    "cli_config": "cli.config_command",
    "cli_inspect": "cli.inspect_command",
    "cli_logging": "cli.logging_setup",
    "compile_cache": "backend.compile_cache",
    "compile_cache_dynamo": "backend.compile_cache_dynamo",
    "cpu_threads": "cli.bench.cpu_threads",
    "data_parallel": "runner.dp_group",
    "device": "backend.device",
    "distributed": "runner.distributed",
    "envs": "backend.envs",
    "errors": "backend.errors",
    "forward_batch": "backend.forward_batch",
    "forward_context": "backend.context",
    "graph_break": "backend.graph_break",
    "graph_nodes": "backend.graph_nodes",
    "graph_table": "backend.graph_table",
    "hookspecs": "backend.hookspecs",
    "host_guard": "backend.host_guard",
    "integers": "config.integers",
    "memory_estimate": "runner.memory_estimate",
    "model_forward": "backend.model_forward",
    "model_protocol": "runner.model_protocol",
    "models": "reference.models",
    "models.hf": "reference.models.hf",
    "nested": "backend.nested",
    "plot": "cli.plot",
    "pool": "backend.pool",
    "probes": "backend.probes",
    "profiling": "backend.profiling",
    "progress": "backend.progress",
    "real_model": "reference.real_model",
    "registry.loading": "registry.manager",
    "results_schema": "cli.results_schema",
    "runner.capture_plan": "backend.capture_plan",
    "tables": "cli.tables",
    "testing.batches": "reference.batches",
    "testing.kv_cache": "reference.kv_cache",
    "testing.model": "reference.model",
    "testing.model.attention": "reference.model.attention",
    "testing.model.attention_backend": "reference.model.attention_backend",
    "testing.model.causal_lm": "reference.model.causal_lm",
    "testing.model.config": "reference.model.config",
    "testing.model.extend_plan": "reference.model.extend_plan",
    "testing.model.flashinfer_attention": "reference.model.flashinfer_attention",
    "testing.model.layers": "reference.model.layers",
    "testing.model.loading": "reference.model.loading",
    "testing.model.lora": "reference.model.lora",
    "testing.model.paged_attention_model": "reference.model.paged_attention_model",
    "testing.model.planned_standin": "reference.model.planned_standin",
    "testing.model.rope": "reference.model.rope",
    "testing.model.triton_attention": "reference.model.triton_attention",
    "testing.model.triton_kernels": "reference.model.triton_kernels",
    "testing.speculative": "reference.speculative",
    "testing.tensor_parallel": "reference.tensor_parallel",
    "tp_ops": "runner.tp_ops",
    "verify": "runner.verify",
    "weak_ref": "backend.weak_ref",
    "weights": "runner.weights",
}


class _MovedModuleLoader(importlib.abc.Loader):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new
        self.spec: Optional[importlib.machinery.ModuleSpec] = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{self.old} is deprecated: import {self.new} instead (the old path is removed in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The module is already executed; the import system bound it under the deprecated
        # name and set its __spec__ to the deprecated path's: give it its own back (reload,
        # importlib.resources and submodule search read it).
        module.__spec__ = self.spec


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old module paths of :data:`MOVED_MODULES` (first on ``sys.meta_path``, so an
    old path never loads a second copy of a module through its new package's ``__path__``)."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]] = None, target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        prefix = __name__ + "."
        if not fullname.startswith(prefix):
            return None
        new = MOVED_MODULES.get(fullname[len(prefix) :])
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedModuleLoader(fullname, f"{prefix}{new}"))


if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModuleFinder())
