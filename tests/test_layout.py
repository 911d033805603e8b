"""The package layout: layers, import cycles, the old module paths (docs/architecture.md).

Layers, lowest first: ``config`` < ``backend`` < ``registry`` < ``runner`` < ``reference``; above
them ``cli`` (the command) and ``testing`` (fakes, conformance kit), which never import each
other. A module imports its own layer or a lower one. The package's ``__init__`` / ``__main__``
(the facade: lazy names, the old-path finder) sit outside the layers; any module may import the
package itself (``__version__``).

How imports are counted:

* the layer rule counts every import a module states: at module level, under
  ``if TYPE_CHECKING:`` and inside functions (a lazy upward import is still an upward
  dependency, only hidden until it runs);
* the cycle rule counts the imports a module runs when it is loaded (module level, outside
  ``if TYPE_CHECKING:``): those decide whether the package imports at all, in every order. An
  import inside a function runs after both modules are loaded, so it cannot fail on a cycle;
  it is still bound by the layer rule.

Plugins (``plugins/*``, ``examples/acme_backend``) import the core through
``cuda_graph_runner.backend`` (and ``.testing`` for the helpers they ship); their tests through
those two only (``testing.workload`` holds the runners, config, models, batches and registry),
import lines in the code strings they run in subprocesses included, and no module of the
core's ``tests/`` folder (pytest's ``pythonpath``), whose helpers import any layer.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core"
PACKAGE = CORE / "cuda_graph_runner"
NAME = "cuda_graph_runner"

#: layer -> the layers it may import (its own included)
ALLOWED = {
    "config": {"config"},
    "backend": {"config", "backend"},
    "registry": {"config", "backend", "registry"},
    "runner": {"config", "backend", "registry", "runner"},
    "reference": {"config", "backend", "registry", "runner", "reference"},
    "testing": {"config", "backend", "registry", "runner", "reference", "testing"},
    "cli": {"config", "backend", "registry", "runner", "reference", "cli"},
}


def _modules() -> Dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(CORE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _facade_exports() -> Dict[str, str]:
    """The package root's lazy names -> the module (relative) each is read from."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        target = (
            node.target
            if isinstance(node, ast.AnnAssign)
            else (node.targets[0] if isinstance(node, ast.Assign) else None)
        )
        if getattr(target, "id", "") == "_EXPORTS":
            return ast.literal_eval(node.value)
    raise AssertionError("_EXPORTS not found in the package's __init__")


EXPORTS = _facade_exports()


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else ""


def _imports(
    module: str, path: Path, modules: Dict[str, Path] = MODULES, exports: Dict[str, str] = EXPORTS
) -> Iterator[Tuple[str, int, bool]]:
    """(imported module, line, runs at load time) for each core module ``module`` imports; a
    name read from the package root (``from cuda_graph_runner import X``) counts as an import
    of the module the root reads it from."""
    is_package = path.name == "__init__.py"

    def targets(node: ast.AST) -> List[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names if a.name.split(".")[0] == NAME]
        assert isinstance(node, ast.ImportFrom)
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            name = ".".join(base + ([node.module] if node.module else []))
        else:
            name = node.module or ""
        if name.split(".")[0] != NAME:
            return []
        found = []
        for a in node.names:
            if f"{name}.{a.name}" in modules:
                found.append(f"{name}.{a.name}")
            elif name == NAME and a.name in exports:
                found.append(f"{NAME}.{exports[a.name]}")
            else:
                found.append(name)
        return found

    def visit(body: List[ast.stmt], eager: bool) -> Iterator[Tuple[str, int, bool]]:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in targets(node):
                    yield target, node.lineno, eager
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from visit(node.body, False)
            elif isinstance(node, ast.If):
                type_checking = "TYPE_CHECKING" in ast.dump(node.test)
                yield from visit(node.body, eager and not type_checking)
                yield from visit(node.orelse, eager)
            else:  # class bodies, with, for, while, try: the same time as their block
                for field in ("body", "orelse", "finalbody"):
                    yield from visit(getattr(node, field, None) or [], eager)
                for handler in getattr(node, "handlers", None) or []:
                    yield from visit(handler.body, eager)

    yield from visit(ast.parse(path.read_text()).body, True)


def test_every_module_is_in_a_layer_or_the_facade():
    outside = [m for m in MODULES if not _layer(m) and m not in (NAME, f"{NAME}.__main__")]
    assert not outside, f"modules in no layer: {outside}"


def test_every_import_stays_in_its_layer_or_goes_lower():
    upward = []
    for module, path in MODULES.items():
        layer = _layer(module)
        if not layer:
            continue
        for target, line, _ in _imports(module, path):
            target_layer = _layer(target)
            if target == NAME or target_layer in ALLOWED[layer]:
                continue
            upward.append(f"{path.relative_to(ROOT)}:{line}: {layer} imports {target} ({target_layer or 'facade'})")
    assert not upward, "imports above their layer:\n" + "\n".join(upward)


def _cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def _load_time_edges(modules: Dict[str, Path] = MODULES) -> Dict[str, Set[str]]:
    edges: Dict[str, Set[str]] = {}
    for module, path in modules.items():
        # A package's own __init__ importing its submodules is not a cycle: a submodule finds
        # its package already in sys.modules. Importing ``a.b.c`` from outside ``a.b`` runs
        # ``a.b``'s __init__ first, so that is an edge to the package too.
        own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
        edges[module] = set()
        for t, _, eager in _imports(module, path, modules):
            if not eager:
                continue
            parts = t.split(".")
            for i in range(2, len(parts) + 1):
                target = ".".join(parts[:i])
                if target in modules and target not in own:
                    edges[module].add(target)
    return edges


def test_no_import_cycle_at_load_time():
    cycles = _cycles(_load_time_edges())
    assert not cycles, f"modules importing each other when loaded: {cycles}"


def test_the_cycle_check_finds_a_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c"]]


def _scratch_package(tmp_path: Path, files: Dict[str, str]) -> Dict[str, Path]:
    modules = {}
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        parts = list(Path(rel).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def test_a_cycle_through_a_package_init_is_found(tmp_path):
    # zz_a -> sub.b runs sub/__init__ first, which imports sub.c, which imports zz_a.
    modules = _scratch_package(
        tmp_path,
        {
            f"{NAME}/runner/zz_a.py": f"from {NAME}.runner.sub import b\n",
            f"{NAME}/runner/sub/__init__.py": "from . import c\n",
            f"{NAME}/runner/sub/b.py": "",
            f"{NAME}/runner/sub/c.py": f"from {NAME}.runner import zz_a\n",
        },
    )
    cycles = _cycles(_load_time_edges(modules))
    assert [f"{NAME}.runner.sub", f"{NAME}.runner.sub.c", f"{NAME}.runner.zz_a"] in cycles, cycles


def test_a_name_read_from_the_package_root_counts_as_its_module():
    found = _imports_of_source(
        f"from {NAME} import DecodeCudaGraphRunner, __version__", {"DecodeCudaGraphRunner": "runner"}
    )
    assert found == [f"{NAME}.runner", NAME], found


def _imports_of_source(source: str, exports: Dict[str, str]) -> List[str]:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "m.py"
        path.write_text(source)
        return [t for t, _, _ in _imports(f"{NAME}.config.m", path, exports=exports)]


def test_the_package_has_at_most_25_entries():
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    assert len(entries) <= 25, entries


def _moved() -> Dict[str, str]:
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "MOVED_MODULES":
            return ast.literal_eval(node.value)
    raise AssertionError("MOVED_MODULES not found")


MOVED = _moved()


def test_each_old_path_is_the_new_module_with_one_deprecation_warning():
    code = f"""
import importlib, json, sys, warnings
moved = {MOVED!r}
out = {{}}
for old, new in moved.items():
    try:
        target = importlib.import_module("{NAME}." + new)
    except ImportError as exc:  # an optional dependency (triton, flashinfer) is missing
        target = exc.name
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            module = importlib.import_module("{NAME}." + old)
            same = module is importlib.import_module("{NAME}." + old) is target
            same = same and module.__spec__.name == "{NAME}." + new  # its own spec, not the old path's
        except ImportError as exc:  # the same missing dependency as the new path
            same = exc.name == target
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)
                and "is deprecated" in str(w.message)]
    out[old] = [same, messages]
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    for old, (same, messages) in result.items():
        assert same, f"{NAME}.{old} is not the module {NAME}.{MOVED[old]}"
        expected = f"{NAME}.{old} is deprecated: import {NAME}.{MOVED[old]} instead"
        assert len(messages) == 1 and messages[0].startswith(expected), (old, messages)


def test_old_paths_of_names_and_the_entry_point_keep_working():
    code = f"""
import warnings
warnings.simplefilter("ignore", DeprecationWarning)
from {NAME}.backend import ShapeKey, BaseCudaGraphBackend, DisabledBackend
from {NAME} import envs, hookspecs, forward_batch
from {NAME}.hookspecs import BackendSpec
from {NAME}.testing.model import ReferenceLlamaForCausalLM
from {NAME}.testing.batches import GreedySession
from {NAME}.reference.batches import GreedySession as New
assert New is GreedySession and hookspecs.BackendSpec is BackendSpec
from importlib.metadata import entry_points
(ep,) = [e for e in entry_points(group="console_scripts") if e.name == "cuda-graph-runner"]
assert ep.value == "{NAME}.cli:main", ep.value
from {NAME}.cli.command import main
assert ep.load() is main
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    assert proc.returncode == 0, proc.stderr


def _env() -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CORE), env.get("PYTHONPATH")]))
    return env


# -- nothing in the repository uses an old path -------------------------------------------------

_OLD = re.compile(
    r"\b" + re.escape(NAME) + r"\.(" + "|".join(sorted(map(re.escape, MOVED), key=len, reverse=True)) + r")(?![\w])"
)
_OLD_TOP = {old for old in MOVED if "." not in old}


def _repo_files() -> Iterator[Path]:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    for name in listed.stdout.split():
        path = ROOT / name
        if (
            path.suffix in (".py", ".md", ".toml", ".sh")
            and path.is_file()
            # the layout test and the flat-layout guide's plugin name old paths on purpose
            and name not in ("CHANGELOG.md", "tests/test_layout.py", "tests/test_old_guide_plugin.py")
        ):
            yield path


def test_the_repository_names_no_old_module_path():
    found = []
    for path in _repo_files():
        text = path.read_text()
        lines = text.splitlines()
        for match in _OLD.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            if lines[line - 1].rstrip().endswith("# flat layout"):  # code reading an older checkout
                continue
            found.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0)}")
        if path.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(text)):
            # `from cuda_graph_runner import envs` names an old module without its dotted path
            if isinstance(node, ast.ImportFrom) and node.module == NAME and node.level == 0:
                for alias in node.names:
                    if alias.name in _OLD_TOP:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {NAME} import {alias.name}")
    assert not found, "old module paths (use the new ones):\n" + "\n".join(found)


def test_deprecated_registry_names_warn_once_and_are_the_same_objects():
    code = f"""
import importlib, json, warnings
import {NAME}.registry as registry
out = {{}}
for name, (module, attribute) in registry._MOVED_NAMES.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = getattr(registry, name)
        second = getattr(registry, name)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    out[name] = [first is second is getattr(importlib.import_module(module), attribute), messages]
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    assert proc.returncode == 0, proc.stderr
    for name, (same, messages) in json.loads(proc.stdout.splitlines()[-1]).items():
        assert same, name
        assert len(messages) == 1 and messages[0].startswith(f"{NAME}.registry.{name} is deprecated"), (name, messages)


def test_the_registry_exports_only_its_own_names():
    import cuda_graph_runner.registry as registry

    assert len(registry.__all__) <= 28 and all(hasattr(registry, name) for name in registry.__all__)
    assert not set(registry.__all__) & set(registry._MOVED_NAMES)


def _plugin_roots() -> List[Path]:
    return sorted(p for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").exists()) + [
        ROOT / "examples" / "acme_backend"
    ]


def _plugin_sources() -> List[Path]:
    roots = [p for p in (ROOT / "plugins").glob("*/cuda_graph_runner_*") if p.is_dir()]
    roots += [p for p in (ROOT / "examples" / "acme_backend").iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    return sorted(f for r in roots for f in r.rglob("*.py"))


def _plugin_tests() -> List[Path]:
    return sorted(f for r in _plugin_roots() for f in (r / "tests").rglob("*.py"))


#: an import statement on a line of a string: code a test runs in a subprocess
_CODE_IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+([\w.]+)[ \t]+import\b|import[ \t]+([\w.]+))", re.M)


def _core_test_module(name: str, beside: Path, core_tests: Path = ROOT / "tests") -> str:
    """The file under the core's ``tests/`` folder (relative to the repository) that the
    top-level module ``name`` resolves to for a test in folder ``beside``, or ``""``: the
    test's own folder comes first on ``sys.path`` (pytest's rootdir-less import), and
    ``tests/`` is on it too (pyproject's ``pythonpath``), so a name only there is the core's
    test code, which imports any layer."""
    top = name.split(".")[0]
    if not top or (beside / f"{top}.py").exists() or (beside / top / "__init__.py").exists():
        return ""
    for candidate in (core_tests / f"{top}.py", core_tests / top / "__init__.py"):
        if candidate.exists():
            return str(candidate.relative_to(ROOT) if candidate.is_relative_to(ROOT) else candidate)
    return ""


def _core_imports_beside_the_plugin_api(path: Path, core_tests: Path = ROOT / "tests") -> List[str]:
    """``path:line: module`` for each import of the core other than ``cuda_graph_runner.backend``
    or ``cuda_graph_runner.testing`` (and their submodules) in ``path``, and ``path:line:
    module (file)`` for each top-level module that resolves to a file of the core's
    ``tests/`` folder (``core_tests``): statements anywhere in the file, and import lines in
    its strings (code it runs in a subprocess)."""
    found: Set[Tuple[int, str]] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [(a.name, node.lineno) for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and not node.level:
            names = [(node.module or "", node.lineno)]
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            for match in _CODE_IMPORT.finditer(node.value):
                line = node.lineno + node.value.count("\n", 0, match.start())
                names.append((match.group(1) or match.group(2), line))
        for name, line in names:
            parts = name.split(".")
            if parts[0] == NAME and (len(parts) < 2 or parts[1] not in ("backend", "testing")):
                found.add((line, name))
            elif _core_test_module(name, path.parent, core_tests):
                found.add((line, f"{name} ({_core_test_module(name, path.parent, core_tests)})"))
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    return [f"{shown}:{line}: {name}" for line, name in sorted(found)]


def test_plugin_sources_import_the_core_through_backend_only():
    # A plugin's code (not its tests) reads the core through the plugin API, and a
    # testing helper it ships through cuda_graph_runner.testing.
    sources = _plugin_sources()
    assert len(sources) > 10, sources
    outside = [hit for path in sources for hit in _core_imports_beside_the_plugin_api(path)]
    assert not outside, "plugin code importing the core beside cuda_graph_runner.backend:\n" + "\n".join(outside)


def test_plugin_and_example_tests_import_the_core_through_backend_and_testing_only():
    # A plugin's tests are what its author writes against the published core: the plugin
    # API and cuda_graph_runner.testing (its workload module: runners, config, model, batches,
    # registry), nothing else: not the core's tests/ helpers either (they import any layer).
    tests = _plugin_tests()
    untested = [str(r.relative_to(ROOT)) for r in _plugin_roots() if not any((r / "tests").glob("test_*.py"))]
    assert not untested, f"no tests/test_*.py found in {untested}"
    outside = [hit for path in tests for hit in _core_imports_beside_the_plugin_api(path)]
    assert not outside, (
        "plugin tests importing the core beside cuda_graph_runner.backend and .testing, or the core's tests/:\n"
        + "\n".join(outside)
    )


def test_the_plugin_import_check_finds_each_way_of_reaching_the_core(tmp_path):
    path = tmp_path / "test_x.py"
    path.write_text(
        f"""import {NAME}.runner
from {NAME} import registry
from {NAME}.backend import ShapeKey
from {NAME}.testing.workload import DecodeCudaGraphRunner
import {NAME}_full.backend


def test_y():
    from {NAME}.reference.batches import make_dummy_prompts
    code = \"\"\"
        import json
        from {NAME}.config import CudaGraphConfig
        from {NAME}.testing.workload import get_registry
    \"\"\"
"""
    )
    assert _core_imports_beside_the_plugin_api(path) == [
        f"test_x.py:1: {NAME}.runner",
        f"test_x.py:2: {NAME}",
        f"test_x.py:9: {NAME}.reference.batches",
        f"test_x.py:12: {NAME}.config",
    ]


def test_the_plugin_import_check_finds_a_module_of_the_core_tests_folder(tmp_path):
    # A plugin test reaching the core's tests/ helpers (on pytest's pythonpath) reaches every
    # layer they import; a helper of the same name in the test's own folder shadows them.
    core_tests = tmp_path / "core_tests"
    (core_tests / "shared_pkg").mkdir(parents=True)
    (core_tests / "shared_cases.py").write_text(f"from {NAME}.reference import batches\n")
    (core_tests / "shared_pkg" / "__init__.py").write_text("")
    (core_tests / "shadowed.py").write_text("")
    plugin_tests = tmp_path / "plugin_tests"
    plugin_tests.mkdir()
    (plugin_tests / "shadowed.py").write_text("")
    path = plugin_tests / "test_x.py"
    path.write_text(
        f"""from shared_cases import make_cases
import shared_pkg.sub
import shadowed
from {NAME}.testing.workload import HFCausalLM


def test_y():
    code = "import shared_cases"
"""
    )
    shown = core_tests.relative_to(ROOT) if core_tests.is_relative_to(ROOT) else core_tests
    assert _core_imports_beside_the_plugin_api(path, core_tests) == [
        f"test_x.py:1: shared_cases ({shown / 'shared_cases.py'})",
        f"test_x.py:2: shared_pkg.sub ({shown / 'shared_pkg' / '__init__.py'})",
        f"test_x.py:8: shared_cases ({shown / 'shared_cases.py'})",
    ]
    # the repository's own tests/ folder is what the plugin tests are checked against
    assert (ROOT / "tests" / "plugin_sources.py").exists()
    (plugin_tests / "test_z.py").write_text("from plugin_sources import PluginDist\n")
    assert _core_imports_beside_the_plugin_api(plugin_tests / "test_z.py") == [
        "test_z.py:1: plugin_sources (tests/plugin_sources.py)"
    ]
