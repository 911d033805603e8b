"""``cuda_graph_runner.testing.workload``, the workload a plugin's tests import: a lazy table for
run time, ``if TYPE_CHECKING:`` imports for type checkers and ``__all__`` name the same names
from the same modules; each name is the core's own object; reading the registry's names
imports no torch, and the Hugging Face adapter's names no transformers."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from cuda_graph_runner.testing import workload

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "core" / "cuda_graph_runner" / "testing" / "workload.py"


def _parsed() -> Tuple[Dict[str, str], Dict[str, str], List[str]]:
    """(lazy table name -> module, TYPE_CHECKING import name -> module, ``__all__``), read
    from the source as written; modules relative to the package ``cuda_graph_runner``."""
    tree = ast.parse(SOURCE.read_text())
    table: Dict[str, str] = {}
    typed: Dict[str, str] = {}
    names: List[str] = []
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom) and stmt.level == 2, ast.dump(stmt)
                for alias in stmt.names:
                    assert alias.asname is None and alias.name not in typed, alias.name
                    typed[alias.name] = stmt.module or ""
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
            if getattr(target, "id", "") == "_SOURCES":
                table = ast.literal_eval(node.value)
            elif getattr(target, "id", "") == "__all__":
                names = ast.literal_eval(node.value)
    return table, typed, names


def test_the_lazy_table_the_typed_imports_and_all_name_the_same_names_and_modules():
    table, typed, names = _parsed()
    assert table, "_SOURCES not found"
    assert typed == table
    assert len(names) == len(set(names)) and set(names) == set(table)
    assert workload.__all__ == names


def test_every_name_is_the_object_its_module_defines():
    table, _, _ = _parsed()
    for name, module in table.items():
        assert getattr(workload, name) is getattr(importlib.import_module(f"cuda_graph_runner.{module}"), name), name
    assert set(table) <= set(dir(workload))


def test_an_unknown_name_is_refused_with_what_the_module_provides():
    with pytest.raises(AttributeError, match=r"has no attribute 'DecodeRunner'; it provides .*DecodeCudaGraphRunner"):
        workload.DecodeRunner  # noqa: B018


def test_the_module_imports_no_torch_and_its_registry_names_load_no_runner_or_model():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "core"), env.get("PYTHONPATH")]))
    code = (
        "import sys\n"
        "import cuda_graph_runner.testing.workload as w\n"
        "assert 'torch' not in sys.modules, 'importing the module imported torch'\n"
        "assert 'transformers' not in sys.modules, 'importing the module imported transformers'\n"
        "from cuda_graph_runner.testing.workload import check_backend_class, get_registry, list_backends\n"
        "list_backends()\n"
        "heavy = ('cuda_graph_runner.runner', 'cuda_graph_runner.reference')\n"
        "assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in sys.modules]\n"
        "w.DecodeCudaGraphRunner, w.PagedKVCache\n"
        "assert all(m in sys.modules for m in heavy)\n"
        "w.HFCausalLM, w.builtin_config, w.eager_reference\n"
        "assert 'transformers' not in sys.modules, 'reading the HF names imported transformers'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
