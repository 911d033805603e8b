"""The package root's names: a lazy table for run time, ``if TYPE_CHECKING:`` imports for type
checkers and ``__all__``, all three naming the same names from the same modules."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import cuda_graph_runner

ROOT = Path(__file__).resolve().parents[1]
INIT = ROOT / "core" / "cuda_graph_runner" / "__init__.py"


def _parsed() -> Tuple[Dict[str, str], Dict[str, str], List[str]]:
    """(lazy table name -> module, TYPE_CHECKING import name -> module, ``__all__``), read
    from the source as written."""
    tree = ast.parse(INIT.read_text())
    table: Dict[str, str] = {}
    typed: Dict[str, str] = {}
    names: List[str] = []
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom) and stmt.level == 1, ast.dump(stmt)
                for alias in stmt.names:
                    assert alias.asname is None and alias.name not in typed, alias.name
                    typed[alias.name] = stmt.module or ""
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id == "_EXPORTS":
                table = ast.literal_eval(node.value)
            elif node.targets[0].id == "__all__":
                names = ast.literal_eval(node.value)  # a literal list: what type checkers read
    return table, typed, names


def test_the_lazy_table_the_typed_imports_and_all_name_the_same_names_and_modules():
    table, typed, names = _parsed()
    assert table, "_EXPORTS not found"
    assert typed == table  # each name imported for type checkers from the module it is loaded from
    assert len(names) == len(set(names)) and set(names) == set(table) | {"__version__"}
    assert cuda_graph_runner.__all__ == names


def test_every_lazy_name_loads_the_object_its_module_defines():
    import importlib

    table, _, _ = _parsed()
    for name, module in table.items():
        assert getattr(cuda_graph_runner, name) is getattr(importlib.import_module(f"cuda_graph_runner.{module}"), name)
    assert set(table) <= set(dir(cuda_graph_runner))


def test_importing_the_package_and_its_registry_errors_imports_no_torch():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "core"), env.get("PYTHONPATH")]))
    code = (
        "import sys, cuda_graph_runner as c; "
        "assert 'torch' not in sys.modules, 'import cuda_graph_runner imported torch'; "
        "c.CudaGraphRunnerError, c.CudaGraphConfigError, c.UnknownBackendError, c.BackendUnavailableError; "
        "assert 'torch' not in sys.modules, 'reading an error imported torch'"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
