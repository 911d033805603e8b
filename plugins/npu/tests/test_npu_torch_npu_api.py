"""The torch_npu graph API the ``npu`` plugin calls, checked against the real torch-npu wheel.

The wheel is read with ``zipfile`` and ``ast``; nothing from it is imported (it needs
the Ascend CANN libraries). It is looked for in a cache directory and, when absent,
fetched once with ``pip download --no-deps`` (pure-Python files are all we read, so
one pinned platform tag serves every machine). Without network or index the tests
skip and say why.

Environment:
    CUDA_GRAPH_RUNNER_WHEEL_CACHE: the cache directory
        (default ``~/.cache/cuda-graph-runner/wheels``).
    CUDA_GRAPH_RUNNER_TORCH_NPU_VERSION: the torch-npu version to check (default 2.13.0).
    CUDA_GRAPH_RUNNER_TORCH_NPU_DOWNLOAD=0: never download; skip when not cached.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Dict, List

import pytest

from cuda_graph_runner.backend import envs
from cuda_graph_runner_npu.testing import CudaBackedNPUModule, RecordingNPUModule
from cuda_graph_runner_npu.torch_npu_api import DEFAULT_UPDATE_INPUT_NAME, GRAPH_API, NPUGRAPH_API

VERSION = envs.get(envs.TORCH_NPU_VERSION)
CACHE = Path(envs.get(envs.WHEEL_CACHE) or Path.home() / ".cache" / "cuda-graph-runner" / "wheels")
DOWNLOAD_TIMEOUT_S = 240


def _cached_wheel():
    found = sorted(CACHE.glob(f"torch_npu-{VERSION}-*.whl"))
    return found[-1] if found else None


def _download() -> str:
    """Try to fetch the wheel into the cache; returns why it failed ("" on success)."""
    if not envs.get(envs.TORCH_NPU_DOWNLOAD):
        return "downloading is off (CUDA_GRAPH_RUNNER_TORCH_NPU_DOWNLOAD=0)"
    CACHE.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.11",
        "--implementation",
        "cp",
        "--platform",
        "manylinux_2_28_x86_64",
        "--retries",
        "1",
        "--timeout",
        "20",
        "--disable-pip-version-check",
        "-q",
        f"torch-npu=={VERSION}",
        "-d",
        str(CACHE),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"pip download timed out after {DOWNLOAD_TIMEOUT_S} s"
    except OSError as exc:
        return f"pip could not run: {exc}"
    if proc.returncode != 0:
        tail = " ".join((proc.stderr or proc.stdout).split())[-300:]
        return f"pip download failed (exit {proc.returncode}): {tail}"
    return ""


@pytest.fixture(scope="module")
def wheel():
    path = _cached_wheel()
    if path is None:
        why = _download()
        path = _cached_wheel()
        if path is None:
            pytest.skip(f"torch-npu {VERSION} wheel not available: none in {CACHE} and {why or 'no wheel was saved'}")
    with zipfile.ZipFile(path) as zf:
        yield zf


def parse(zf: zipfile.ZipFile, name: str) -> ast.Module:
    return ast.parse(zf.read(name).decode("utf-8"), filename=name)


def top_level(tree: ast.Module) -> Dict[str, ast.AST]:
    return {n.name: n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}


def methods(cls: ast.ClassDef) -> Dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def param_names(fn: ast.FunctionDef) -> List[str]:
    a = fn.args
    return [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]


def required_params(fn: ast.FunctionDef) -> List[str]:
    a = fn.args
    positional = a.posonlyargs + a.args
    required = positional[: len(positional) - len(a.defaults)]
    return [p.arg for p in required if p.arg not in ("self", "cls")]


@pytest.fixture(scope="module")
def graphs(wheel):
    return top_level(parse(wheel, "torch_npu/npu/graphs.py"))


def test_torch_npu_npu_exports_every_name_the_backend_calls(wheel):
    tree = parse(wheel, "torch_npu/npu/__init__.py")
    (exported,) = [
        ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in n.targets)
    ]
    missing = sorted(set(GRAPH_API) - set(exported))
    assert not missing, f"torch_npu.npu does not export {missing}"


def test_graph_context_takes_the_graph_positionally_and_every_keyword_passed(graphs):
    init = methods(graphs["graph"])["__init__"]
    names = param_names(init)
    assert names[0] == "self" and len(names) > 1  # graph(npu_graph, ...): the graph goes first
    assert required_params(init) == [names[1]]
    missing = [kw for kw in GRAPH_API["graph"] if kw not in names]
    assert not missing, f"torch.npu.graph{tuple(names)} lacks {missing}"


def test_npugraph_methods_and_update_keyword(graphs):
    cls = graphs["NPUGraph"]
    found = methods(cls)
    for name, keywords in NPUGRAPH_API.items():
        assert name in found, f"NPUGraph has no {name}"
        assert all(kw in param_names(found[name]) for kw in keywords), f"NPUGraph.{name}{param_names(found[name])}"
    assert required_params(found["update"]) == ["cpu_update_input"]


def test_update_needs_auto_dispatch_capture_which_graph_sets_on_the_graph(graphs):
    # NPUGraph.update raises unless the graph was captured with auto_dispatch_capture=True,
    # and graph(...) is what sets that flag: so the backend must pass it at capture.
    update = methods(graphs["NPUGraph"])["update"]
    reads = [n for n in ast.walk(update) if isinstance(n, ast.Attribute) and n.attr == "auto_dispatch_capture"]
    raises = [n for n in ast.walk(update) if isinstance(n, ast.Raise)]
    assert reads and raises
    init = methods(graphs["graph"])["__init__"]
    sets = [
        t
        for n in ast.walk(init)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Attribute) and t.attr == "auto_dispatch_capture"
    ]
    assert sets, "graph.__init__ does not set npu_graph.auto_dispatch_capture"


def test_graph_pool_handle_takes_no_argument(graphs):
    assert required_params(graphs["graph_pool_handle"]) == []


def test_one_update_dict_is_applied_to_every_recorded_op(wheel):
    # The backend sends [{name: seq_lens}] and relies on torch_npu broadcasting it.
    tree = parse(wheel, "torch_npu/npu/graphs.py")
    (fn,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "update_capture_record"]
    compares = [ast.unparse(n) for n in ast.walk(fn) if isinstance(n, ast.Compare)]
    assert "len(cpu_update_input) == 1" in compares


def test_default_update_input_name_is_one_torch_npu_rebinds(wheel):
    handler_files = [
        n for n in wheel.namelist() if n.startswith("torch_npu/npu/_npugraph_handlers/") and n.endswith(".py")
    ]
    files = handler_files or ["torch_npu/npu/graphs.py"]
    strings = {
        n.value
        for f in files
        for n in ast.walk(parse(wheel, f))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }
    assert DEFAULT_UPDATE_INPUT_NAME in strings, f"no graph handler in {files} names {DEFAULT_UPDATE_INPUT_NAME!r}"


@pytest.mark.parametrize("double", [RecordingNPUModule, CudaBackedNPUModule])
def test_test_doubles_mirror_the_real_signatures(graphs, double):
    module = double()
    real_graph = param_names(methods(graphs["graph"])["__init__"])[1:]
    assert list(inspect.signature(module.graph).parameters) == real_graph
    real_update = param_names(methods(graphs["NPUGraph"])["update"])[1:]
    assert list(inspect.signature(module.NPUGraph.update).parameters)[1:] == real_update
