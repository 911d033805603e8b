"""One error hierarchy: every error of the package and its plugins is a CudaGraphRunnerError,
keeps its standard base, and (the package's) is importable from ``cuda_graph_runner``."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pkgutil
from pathlib import Path
from types import ModuleType
from typing import Dict, List, Tuple, Type

import pytest
import torch

import cuda_graph_runner
from cuda_graph_runner import CudaGraphRunnerError

#: exported error -> the standard base it keeps (code catching that catches the error too)
STANDARD_BASES: Dict[str, type] = {
    "CudaGraphConfigError": ValueError,
    "UnknownBackendError": KeyError,
    "BackendUnavailableError": RuntimeError,
    "BackendLoadError": ImportError,
    "BackendContractError": TypeError,
    "BackendConflictError": RuntimeError,
    "RegistryReentryError": RuntimeError,
    "CudaGraphHostValueError": RuntimeError,
    "CudaGraphVerifyError": RuntimeError,
    "CompileCacheError": OSError,
    "EnvVarError": ValueError,
    "UnsupportedStructureError": TypeError,
    "CaptureTraceError": ValueError,
    "CaptureOutOfMemoryError": torch.OutOfMemoryError,
    "OutputRowsError": ValueError,
    "RunnerAsleepError": RuntimeError,
    "StaleWeightsError": RuntimeError,
    "TensorParallelMismatchError": RuntimeError,
    "TensorParallelCaptureError": RuntimeError,
    "TensorParallelStepError": RuntimeError,
    "DataParallelMismatchError": RuntimeError,
    "DataParallelStepError": RuntimeError,
    "CacheFullError": RuntimeError,
    "FlashInferPlanError": RuntimeError,
    "UnplannedForwardError": RuntimeError,
    "StalePlanError": RuntimeError,
    "RealModelUnavailableError": RuntimeError,
    "UnsupportedHFModelError": ValueError,
    "TransformersUnavailableError": RuntimeError,
    "RankFailure": RuntimeError,
    "ResultsSchemaError": ValueError,
    "PlotUnavailableError": RuntimeError,
    "BenchRequestError": Exception,
}

PLUGIN_PACKAGES = [
    "cuda_graph_runner_breakable",
    "cuda_graph_runner_compiled",
    "cuda_graph_runner_full",
    "cuda_graph_runner_npu",
    "cuda_graph_runner_tc_piecewise",
]


def _exported_errors() -> Dict[str, type]:
    values = {name: getattr(cuda_graph_runner, name) for name in cuda_graph_runner.__all__}
    return {n: v for n, v in values.items() if inspect.isclass(v) and issubclass(v, BaseException)}


#: optional dependencies a module may import at load time (a module needing a missing one is
#: read as source instead)
OPTIONAL = {"triton", "flashinfer", "transformers", "torch_npu", "matplotlib"}


def _modules(package: ModuleType) -> Tuple[List[ModuleType], List[Path]]:
    """``package`` and every module under it: (imported, the files of those that need a missing
    optional dependency). ``__main__`` modules are left out: importing one runs the command."""
    imported, unimportable = [package], []
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if info.name.rsplit(".", 1)[-1] == "__main__":
            continue
        try:
            imported.append(importlib.import_module(info.name))
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] not in OPTIONAL:
                raise
            spec = importlib.util.find_spec(info.name)
            assert spec is not None and spec.origin is not None
            unimportable.append(Path(spec.origin))
    return imported, unimportable


def _error_like_classes(path: Path) -> List[str]:
    """Public classes of a module's source whose bases are named like exceptions."""

    def named(base: ast.expr) -> str:
        return base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")

    return [
        node.name
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
        and not node.name.startswith("_")
        and any(named(b).endswith(("Error", "Exception", "Failure")) for b in node.bases)
    ]


def _defined_errors(package: ModuleType) -> Dict[str, Type[BaseException]]:
    """Every public exception class defined in a module of ``package`` (name -> class); a
    module that cannot be imported here must define none (read from its source)."""
    found: Dict[str, Type[BaseException]] = {}
    imported, unimportable = _modules(package)
    for module in imported:
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
                and not name.startswith("_")
            ):
                found[name] = value
    unseen = {str(path): _error_like_classes(path) for path in unimportable}
    assert not any(unseen.values()), f"errors in modules not importable here (import them elsewhere): {unseen}"
    return found


def test_every_exported_error_derives_from_the_base_and_keeps_its_standard_base():
    exported = _exported_errors()
    assert set(exported) - {"CudaGraphRunnerError"} == set(STANDARD_BASES)
    for name, error in exported.items():
        assert issubclass(error, CudaGraphRunnerError), name
        assert issubclass(error, STANDARD_BASES.get(name, Exception)), name
    assert CudaGraphRunnerError.__bases__ == (Exception,)


def test_every_error_the_package_defines_is_exported_from_the_top_level():
    defined = _defined_errors(cuda_graph_runner)
    assert set(defined) >= {"CudaGraphConfigError", "UnknownBackendError", "TensorParallelMismatchError"}
    not_exported = sorted(set(defined) - set(cuda_graph_runner.__all__))
    assert not not_exported, f"errors missing from cuda_graph_runner.__all__: {not_exported}"
    assert {name: getattr(cuda_graph_runner, name) for name in defined} == defined
    outside = sorted(name for name, error in defined.items() if not issubclass(error, CudaGraphRunnerError))
    assert not outside, f"errors not derived from CudaGraphRunnerError: {outside}"


@pytest.mark.parametrize("package", PLUGIN_PACKAGES)
def test_every_plugin_error_derives_from_the_base_the_plugin_api_exports(package):
    from cuda_graph_runner.backend import CudaGraphRunnerError as from_plugin_api

    assert from_plugin_api is CudaGraphRunnerError
    defined = _defined_errors(importlib.import_module(package))
    outside = sorted(name for name, error in defined.items() if not issubclass(error, CudaGraphRunnerError))
    assert not outside, f"{package} errors not derived from CudaGraphRunnerError: {outside}"


def test_one_except_clause_catches_a_config_error_and_an_unknown_backend():
    from cuda_graph_runner import registry

    for fails in (
        lambda: cuda_graph_runner.CudaGraphConfig.from_dict({"decode": {"max_bs": -1}}),
        lambda: registry.resolve_decode_backend("no_such_backend", device="cpu"),
    ):
        with pytest.raises(CudaGraphRunnerError):
            fails()
