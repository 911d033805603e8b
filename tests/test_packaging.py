"""The distributions' metadata, read from the pyproject files (no build: CI's
.ci/example_plugin.sh builds every wheel with the lowest declared setuptools and
installs ``cuda-graph-runner[all]`` from them)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROJECTS = {
    ".": "core/cuda_graph_runner",
    "plugins/full": "plugins/full/cuda_graph_runner_full",
    "plugins/breakable": "plugins/breakable/cuda_graph_runner_breakable",
    "plugins/tc_piecewise": "plugins/tc_piecewise/cuda_graph_runner_tc_piecewise",
    "plugins/npu": "plugins/npu/cuda_graph_runner_npu",
    "plugins/compiled": "plugins/compiled/cuda_graph_runner_compiled",
    "examples/acme_backend": "examples/acme_backend/acme_cgr",
}


def load(project: str) -> dict:
    with open(ROOT / project / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def test_every_distribution_is_found():
    found = {str(p.parent.relative_to(ROOT)) for p in ROOT.glob("plugins/*/pyproject.toml")}
    assert found == {p for p in PROJECTS if p.startswith("plugins/")}


@pytest.mark.parametrize("project", sorted(PROJECTS))
def test_version_single_sourced_license_and_py_typed(project):
    data = load(project)
    package_dir = ROOT / PROJECTS[project]
    package = package_dir.name
    assert "version" not in data["project"] and data["project"]["dynamic"] == ["version"]
    assert data["tool"]["setuptools"]["dynamic"]["version"] == {"attr": f"{package}.__version__"}
    init = ast.parse((package_dir / "__init__.py").read_text())
    versions = [
        node.value.value
        for node in init.body
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["__version__"]
    ]
    assert len(versions) == 1 and re.fullmatch(r"\d+\.\d+\.\d+", versions[0])  # a literal setuptools reads statically
    assert data["project"]["license"] == "Apache-2.0" and data["project"]["license-files"] == ["LICENSE"]
    assert (ROOT / project / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()
    assert (package_dir / "py.typed").is_file()
    assert data["tool"]["setuptools"]["package-data"][package] == ["py.typed"]


def test_one_setuptools_floor_that_knows_license_expressions():
    floors = {p: load(p)["build-system"]["requires"] for p in PROJECTS}
    assert len({tuple(r) for r in floors.values()}) == 1, floors
    [spec] = floors["."]
    floor = tuple(int(x) for x in re.fullmatch(r"setuptools>=([0-9.]+)", spec).group(1).split("."))
    assert floor >= (77, 0, 3)  # PEP 639 `license = "<SPDX>"`; 68.2.2 rejects it


def test_core_extras_name_every_backend_distribution():
    core = load(".")
    extras = core["project"]["optional-dependencies"]
    for project in PROJECTS:
        if project.startswith("plugins/"):
            name = load(project)["project"]["name"]
            extra = name.removeprefix("cuda-graph-runner-")
            assert any(req.startswith(name) for req in extras[extra]), (extra, extras[extra])
            assert extra in extras["all"][0]
    assert extras["testing"] == ["pytest>=7"]
    assert any(r.startswith("matplotlib") for r in extras["plot"])
    assert "testing" in extras["all"][0] and "plot" in extras["all"][0]


def test_torch_range_is_the_tested_one():
    deps = load(".")["project"]["dependencies"]
    [torch_spec] = [d for d in deps if d.startswith("torch")]
    assert torch_spec == "torch>=2.11,<2.14"  # CPU CI: 2.13; GPU runs: 2.11 (docs/benchmarks.md)
    assert any(d.startswith("packaging") for d in deps)
