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
from typing import TYPE_CHECKING, Any, Optional, Sequence

__version__ = "0.1.0"

if TYPE_CHECKING:  # what type checkers see; at run time each name is loaded on first use
    from .backend import (
        BackendSpec,
        BaseCudaGraphBackend,
        DefaultClaim,
        ForwardBatch,
        ForwardMode,
        ShapeKey,
        eager_op,
        forward_context,
        get_forward_batch,
        hookimpl,
    )
    from .backend.envs import EnvVarError
    from .backend.errors import (
        BackendConflictError,
        BackendContractError,
        BackendLoadError,
        BackendUnavailableError,
        CompileCacheError,
        CudaGraphHostValueError,
        CudaGraphVerifyError,
        RegistryReentryError,
        UnknownBackendError,
    )
    from .backend.nested import UnsupportedStructureError
    from .backend.profiling import CaptureTraceError
    from .cli.bench.backends import BenchRequestError
    from .cli.plot import PlotUnavailableError
    from .cli.results_schema import ResultsSchemaError
    from .config import Backend, CudaGraphConfig, CudaGraphConfigError, Phase, PhaseConfig
    from .config.exceptions import CudaGraphRunnerError
    from .reference.kv_cache import CacheFullError
    from .reference.model.flashinfer_attention import FlashInferPlanError
    from .reference.model.planned_standin import StalePlanError, UnplannedForwardError
    from .reference.models.hf import TransformersUnavailableError, UnsupportedHFModelError
    from .reference.real_model import RealModelUnavailableError
    from .registry import list_backends, register, resolve_decode_backend, resolve_prefill_backend
    from .runner import BaseCudaGraphRunner, DecodeCudaGraphRunner, MixedCudaGraphRunner, PrefillCudaGraphRunner
    from .runner.capture_report import CaptureOutOfMemoryError
    from .runner.distributed import TensorParallelCaptureError, TensorParallelMismatchError, TensorParallelStepError
    from .runner.dp_group import DataParallelMismatchError, DataParallelStepError
    from .runner.memory_estimate import estimate_graph_memory
    from .runner.sizes import OutputRowsError
    from .runner.sleep import RunnerAsleepError
    from .runner.weights import StaleWeightsError
    from .testing.tp_launch import RankFailure

#: public name -> the module (relative to this package) it is read from on first use
_EXPORTS = {
    "CudaGraphConfig": "config",
    "PhaseConfig": "config",
    "Phase": "config",
    "Backend": "config",
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
    "MixedCudaGraphRunner": "runner",
    "PrefillCudaGraphRunner": "runner",
    "estimate_graph_memory": "runner.memory_estimate",
    # every error of the package, each a CudaGraphRunnerError (docs/architecture.md, "Errors")
    "CudaGraphRunnerError": "config.exceptions",
    "CudaGraphConfigError": "config",
    "BackendConflictError": "backend.errors",
    "BackendContractError": "backend.errors",
    "BackendLoadError": "backend.errors",
    "BackendUnavailableError": "backend.errors",
    "CompileCacheError": "backend.errors",
    "CudaGraphHostValueError": "backend.errors",
    "CudaGraphVerifyError": "backend.errors",
    "RegistryReentryError": "backend.errors",
    "UnknownBackendError": "backend.errors",
    "EnvVarError": "backend.envs",
    "UnsupportedStructureError": "backend.nested",
    "CaptureTraceError": "backend.profiling",
    "CaptureOutOfMemoryError": "runner.capture_report",
    "OutputRowsError": "runner.sizes",
    "RunnerAsleepError": "runner.sleep",
    "StaleWeightsError": "runner.weights",
    "TensorParallelCaptureError": "runner.distributed",
    "TensorParallelMismatchError": "runner.distributed",
    "TensorParallelStepError": "runner.distributed",
    "DataParallelMismatchError": "runner.dp_group",
    "DataParallelStepError": "runner.dp_group",
    "CacheFullError": "reference.kv_cache",
    "FlashInferPlanError": "reference.model.flashinfer_attention",
    "StalePlanError": "reference.model.planned_standin",
    "UnplannedForwardError": "reference.model.planned_standin",
    "RealModelUnavailableError": "reference.real_model",
    "TransformersUnavailableError": "reference.models.hf",
    "UnsupportedHFModelError": "reference.models.hf",
    "RankFailure": "testing.tp_launch",
    "BenchRequestError": "cli.bench.backends",
    "PlotUnavailableError": "cli.plot",
    "ResultsSchemaError": "cli.results_schema",
}

__all__ = [
    "Backend",
    "BackendConflictError",
    "BackendContractError",
    "BackendLoadError",
    "BackendSpec",
    "BackendUnavailableError",
    "BaseCudaGraphBackend",
    "BaseCudaGraphRunner",
    "BenchRequestError",
    "CacheFullError",
    "CaptureOutOfMemoryError",
    "CaptureTraceError",
    "CompileCacheError",
    "CudaGraphConfig",
    "CudaGraphConfigError",
    "CudaGraphHostValueError",
    "CudaGraphRunnerError",
    "CudaGraphVerifyError",
    "DataParallelMismatchError",
    "DataParallelStepError",
    "DecodeCudaGraphRunner",
    "DefaultClaim",
    "EnvVarError",
    "FlashInferPlanError",
    "ForwardBatch",
    "ForwardMode",
    "MixedCudaGraphRunner",
    "OutputRowsError",
    "Phase",
    "PhaseConfig",
    "PlotUnavailableError",
    "PrefillCudaGraphRunner",
    "RankFailure",
    "RealModelUnavailableError",
    "RegistryReentryError",
    "ResultsSchemaError",
    "RunnerAsleepError",
    "ShapeKey",
    "StalePlanError",
    "StaleWeightsError",
    "TensorParallelCaptureError",
    "TensorParallelMismatchError",
    "TensorParallelStepError",
    "TransformersUnavailableError",
    "UnknownBackendError",
    "UnplannedForwardError",
    "UnsupportedHFModelError",
    "UnsupportedStructureError",
    "__version__",
    "eager_op",
    "estimate_graph_memory",
    "forward_context",
    "get_forward_batch",
    "hookimpl",
    "list_backends",
    "register",
    "resolve_decode_backend",
    "resolve_prefill_backend",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cuda_graph_runner' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


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
