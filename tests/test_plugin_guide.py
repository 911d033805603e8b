"""docs/plugin-authors.md states the contract the code has: the method table of §3 lists
what the runners call, its count and its abstract methods match the base class, and the
guide's API version is the core's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cuda_graph_runner.backend import BaseCudaGraphBackend
from cuda_graph_runner.backend.hookspecs import PLUGIN_API_VERSION
from cuda_graph_runner.registry.contract import RUNNER_CALLS

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "plugin-authors.md"
WORDS = {2: "two", 7: "seven", 8: "eight", 9: "nine", 10: "ten"}


def _section_3() -> str:
    text = GUIDE.read_text()
    return text[text.index("## 3. The backend class") : text.index("### What a backend gets")]


def test_method_table_lists_what_the_runners_call_and_the_counts_match():
    section = _section_3()
    rows = re.findall(r"^\| `([a-z_]+)\(?[^`]*`? \|", section, flags=re.M)
    methods = [r for r in rows if r != "method"]
    # graph_memory_bytes is the base class's measurement, described under "Out of memory".
    assert set(methods) == set(RUNNER_CALLS) - {"graph_memory_bytes"}, methods
    abstract = sorted(BaseCudaGraphBackend.__abstractmethods__)
    prose = " ".join(section.split())
    assert f"The table lists the **{WORDS[len(methods)]}** methods" in prose
    assert f"You must implement **{WORDS[len(abstract)]}**" in prose
    marked = re.findall(r"^\| `([a-z_]+)\([^|]*\|[^|]*\| \*\*abstract\*\* \|", section, flags=re.M)
    assert sorted(marked) == abstract
    assert f"other {WORDS[len(methods) - len(abstract)]} have defaults" in prose


def test_guide_states_the_current_plugin_api_version():
    text = GUIDE.read_text()
    assert f'currently `"{PLUGIN_API_VERSION}"`' in text
    assert f'api_version="{PLUGIN_API_VERSION}"' in text


def _section(number: int) -> str:
    text = GUIDE.read_text()
    start = text.index(f"## {number}. ")
    return text[start : text.index(f"## {number + 1}. ", start)]


def test_first_template_has_the_test_extra_of_the_example_it_points_to():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    [template] = re.findall(r"```toml\n(.*?)```", _section(1), flags=re.S)
    extras = tomllib.loads(template)["project"]["optional-dependencies"]
    with open(GUIDE.parents[1] / "examples" / "acme_backend" / "pyproject.toml", "rb") as f:
        example = tomllib.load(f)["project"]["optional-dependencies"]
    assert extras["test"] == example["test"] and any(r.startswith("pytest") for r in extras["test"])


def test_wheel_recipe_installs_the_test_extras_from_the_wheels_only():
    lines = [
        line.strip()
        for block in re.findall(r"```bash\n(.*?)```", _section(7), flags=re.S)
        for line in block.splitlines()
        if "cuda-graph-runner" in line and line.strip().startswith("pip install")
    ]
    assert lines, "section 7 lost its install line"
    [line] = lines
    assert "--no-index" in line and "--find-links" in line
    assert "'cuda-graph-runner[testing]'" in line and "'cuda-graph-runner-acme[test]'" in line


def test_the_testing_section_lists_what_the_workload_module_gives():
    from cuda_graph_runner.testing import workload

    section = _section(4)
    listing = section[section.index("### Your own tests") : section.index("Its docstring gives")]
    bullets = "\n".join(line for line in listing.splitlines() if line.startswith(("* ", "  ")))
    assert set(re.findall(r"`(\w+)`", bullets)) == set(workload.__all__)
