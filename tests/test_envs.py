"""One parser for every CUDA_GRAPH_RUNNER_* variable (cuda_graph_runner.backend.envs), one table
of them (the plugins' declared by the plugins), and every reader using it: registry, breakable,
tc_piecewise, the CLI's error for a bad value."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cuda_graph_runner import registry
from cuda_graph_runner.backend import envs
from cuda_graph_runner.testing.fakes import FakeGraphDeviceModule

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "text,expected",
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        (" Yes ", True),
        ("on", True),
        ("On", True),
        ("0", False),
        ("false", False),
        ("False", False),
        ("no", False),
        ("OFF", False),
        (" 0 ", False),
    ],
)
def test_booleans_accept_the_usual_words_in_any_case(monkeypatch, text, expected):
    monkeypatch.setenv(envs.STRICT_PLUGINS, text)
    assert envs.get(envs.STRICT_PLUGINS) is expected


@pytest.mark.parametrize("name,default", [(envs.STRICT_PLUGINS, False), (envs.COMPILE_CACHE, True)])
@pytest.mark.parametrize("text", [None, "", "  "])
def test_unset_or_empty_boolean_means_its_default(monkeypatch, name, default, text):
    if text is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, text)
    assert envs.get(name) is default


@pytest.mark.parametrize("text", ["2", "maybe", "enable", "y", "truee"])
def test_other_boolean_text_is_an_error_naming_variable_value_and_accepted(monkeypatch, text):
    monkeypatch.setenv(envs.GRAPH_NODES, text)
    with pytest.raises(
        envs.EnvVarError,
        match=rf"CUDA_GRAPH_RUNNER_GRAPH_NODES='{text}' is not a boolean; "
        r"accepted: 1/0, true/false, yes/no, on/off",
    ):
        envs.get(envs.GRAPH_NODES)


def test_lists_and_optional_lists(monkeypatch):
    monkeypatch.delenv(envs.PLUGINS, raising=False)
    assert envs.get(envs.PLUGINS) is None  # unset: no restriction
    monkeypatch.setenv(envs.PLUGINS, "")
    assert envs.get(envs.PLUGINS) == []  # empty: none
    monkeypatch.setenv(envs.PLUGINS, " a, ,b ")
    assert envs.get(envs.PLUGINS) == ["a", "b"]
    assert envs.raw(envs.PLUGINS) == " a, ,b "


def test_unknown_variable_and_bad_definitions():
    with pytest.raises(KeyError, match="CUDA_GRAPH_RUNNER_NOPE is not a known"):
        envs.get("CUDA_GRAPH_RUNNER_NOPE")
    with pytest.raises(ValueError, match="must start with 'CUDA_GRAPH_RUNNER_'"):
        envs.define("ACME_FLAG", "bool", False, "x")
    with pytest.raises(ValueError, match="kind 'float' is not one of"):
        envs.define("CUDA_GRAPH_RUNNER_ACME_RATIO", "float", 0.5, "x")
    with pytest.raises(ValueError, match="already defined differently"):
        envs.define(envs.STRICT_PLUGINS, "bool", True, "x")


def test_a_plugin_can_define_its_own_variable(monkeypatch):
    name = envs.define(
        "CUDA_GRAPH_RUNNER_ACME_FAST", "bool", False, "acme: go fast", owner="cuda-graph-runner-acme"
    ).name
    try:
        monkeypatch.setenv(name, "yes")
        assert envs.get(name) is True
        assert any(row["name"] == name and row["owner"] == "cuda-graph-runner-acme" for row in envs.describe())
    finally:
        envs.VARIABLES.pop(name)


def test_every_variable_the_repository_mentions_is_in_the_table():
    mentioned = set()
    for path in (
        list((ROOT / "core").rglob("*.py"))
        + list((ROOT / "plugins").rglob("*.py"))
        + list((ROOT / "tests").rglob("*.py"))
        + list((ROOT / "docs").rglob("*.md"))
        + [ROOT / "README.md"]
    ):
        if ".venv" in path.parts:
            continue
        mentioned |= set(re.findall(r"\bCUDA_GRAPH_RUNNER_[A-Z][A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")))
    registry.environment_variables()
    made_up_here = {"CUDA_GRAPH_RUNNER_NOPE", "CUDA_GRAPH_RUNNER_ACME_RATIO", "CUDA_GRAPH_RUNNER_ACME_FAST"}
    assert mentioned - made_up_here - set(envs.VARIABLES) == set()


def test_nothing_but_envs_reads_the_environment():
    """The kind, not the case: a second parser is how ``...=false`` came to mean on."""
    offenders = []
    for path in list((ROOT / "core").rglob("*.py")) + list((ROOT / "plugins").rglob("*.py")):
        if ".venv" in path.parts or path.name == "envs.py" or "tests" in path.parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            # Copying the whole environment for a child process (dict(os.environ)) reads no flag.
            if re.search(r"os\.environ\.get|os\.getenv|environ\[|\bin os\.environ|from os import .*environ", line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert offenders == []


def _plugin_distributions():
    for plugin in sorted(p for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").is_file()):
        yield plugin, re.search(r'^name = "([^"]+)"', (plugin / "pyproject.toml").read_text(), re.M).group(1)


def test_plugins_declare_their_variables_in_their_registration_module():
    """Each plugin's variables are declared by the plugin (envs.define in the module its entry
    point names, owner: its distribution), none in the core's table, and one table lists them."""
    core_table = (ROOT / "core" / "cuda_graph_runner" / "backend" / "envs.py").read_text()
    listed = {row["name"]: row["owner"] for row in registry.environment_variables()}
    seen = {}
    for plugin, distribution in _plugin_distributions():
        declared = set()
        for path in plugin.rglob("plugin.py"):
            declared |= set(re.findall(r'envs\.define\(\s*"(CUDA_GRAPH_RUNNER_[A-Z0-9_]+)"', path.read_text()))
        for path in plugin.rglob("*.py"):
            if "tests" in path.parts or ".venv" in path.parts:
                continue
            for name in re.findall(r"\bCUDA_GRAPH_RUNNER_[A-Z][A-Z0-9_]*[A-Z0-9]\b", path.read_text()):
                if name in listed and listed[name] == "core":
                    continue  # a core variable the plugin reads
                seen[name] = distribution
                assert name in declared, f"{path.relative_to(ROOT)} reads {name}, which its plugin.py does not declare"
                assert listed[name] == distribution, (name, listed[name])
                assert f'"{name}"' not in core_table, f"{name} is declared in the core's table"
    assert {"CUDA_GRAPH_RUNNER_BREAKABLE_WEAK_REF_ARGS", "CUDA_GRAPH_RUNNER_TC_PIECEWISE_DEBUG"} <= set(seen), seen


def test_the_table_lists_plugin_variables_once_their_plugins_load():
    """In a fresh process: the core's table alone lacks them; the registry's table loads the plugins'
    registration modules and lists them, and the CLI's check covers them."""
    code = (
        "import sys; from cuda_graph_runner.backend import envs\n"
        "name = 'CUDA_GRAPH_RUNNER_TC_PIECEWISE_DEBUG'\n"
        "assert name not in envs.VARIABLES\n"
        "from cuda_graph_runner import registry\n"
        "rows = {r['name']: r['owner'] for r in registry.environment_variables()}\n"
        "assert rows[name] == 'cuda-graph-runner-tc-piecewise', rows\n"
        "from cuda_graph_runner.cli.command import main\n"
        "sys.exit(main(['backends']))\n"
    )
    env = {**os.environ, "CUDA_GRAPH_RUNNER_TC_PIECEWISE_DEBUG": "maybe"}
    env.pop("CUDA_GRAPH_RUNNER_PLUGINS", None)
    env.pop("CUDA_GRAPH_RUNNER_DISABLE_PLUGIN_AUTOLOAD", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "error: CUDA_GRAPH_RUNNER_TC_PIECEWISE_DEBUG='maybe' is not a boolean" in done.stderr


# -- the readers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,expected",
    [("false", False), ("no", False), ("off", False), ("0", False), ("true", True), ("1", True), ("", True)],
)
def test_breakable_weak_ref_args_flag(monkeypatch, text, expected):
    from cuda_graph_runner_breakable.backend import ENV_WEAK_REF_ARGS, BreakableCudaGraphBackend

    monkeypatch.setenv(ENV_WEAK_REF_ARGS, text)
    backend = BreakableCudaGraphBackend("cpu", phase="decode", device_module=FakeGraphDeviceModule())
    assert backend.weak_ref_args is expected


def test_breakable_weak_ref_args_bad_value_is_named(monkeypatch):
    from cuda_graph_runner_breakable.backend import ENV_WEAK_REF_ARGS, BreakableCudaGraphBackend

    monkeypatch.setenv(ENV_WEAK_REF_ARGS, "flase")
    with pytest.raises(envs.EnvVarError, match="CUDA_GRAPH_RUNNER_BREAKABLE_WEAK_REF_ARGS='flase'"):
        BreakableCudaGraphBackend("cpu", phase="decode", device_module=FakeGraphDeviceModule())


@pytest.mark.parametrize("text,expected", [("false", False), ("off", False), ("yes", True), ("", False)])
def test_tc_piecewise_debug_flag(monkeypatch, text, expected):
    from cuda_graph_runner_tc_piecewise.backend import ENV_DEBUG, TcPiecewiseCudaGraphBackend

    monkeypatch.setenv(ENV_DEBUG, text)
    assert TcPiecewiseCudaGraphBackend("cpu", phase="decode").debug is expected


@pytest.mark.parametrize("var", [registry.ENV_STRICT, registry.ENV_DISABLE_AUTOLOAD])
def test_registry_flags_use_the_parser(monkeypatch, var):
    monkeypatch.setenv(var, "Off")
    registry.reset_registry()
    assert "full" in registry.get_registry().names()
    monkeypatch.setenv(var, "sometimes")
    registry.reset_registry()
    with pytest.raises(envs.EnvVarError, match=f"{var}='sometimes' is not a boolean"):
        registry.get_registry().names()
    monkeypatch.setenv(var, "no")  # fixed: nothing was cached
    assert "full" in registry.get_registry().names()


def test_disable_autoload_accepts_true(monkeypatch):
    monkeypatch.setenv(registry.ENV_DISABLE_AUTOLOAD, "TRUE")
    registry.reset_registry()
    assert registry.get_registry().names() == ["disabled"]


def test_cli_reports_a_bad_value_without_a_traceback(monkeypatch, capsys):
    from cuda_graph_runner.cli.command import main

    monkeypatch.setenv(registry.ENV_DISABLE_AUTOLOAD, "perhaps")
    registry.reset_registry()
    assert main(["backends"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: CUDA_GRAPH_RUNNER_DISABLE_PLUGIN_AUTOLOAD='perhaps' is not a boolean")
    assert "Traceback" not in err


def test_class_names_in_the_help_are_classes_that_exist():
    """A help text naming a class (``BreakableCudaGraphBackend``) names one the sources define."""
    defined = set()
    for path in list((ROOT / "core").rglob("*.py")) + list((ROOT / "plugins").rglob("*.py")):
        if ".venv" not in path.parts:
            defined |= set(re.findall(r"^\s*class\s+(\w+)", path.read_text(), re.M))
    quoted = {
        (row["name"], word)
        for row in registry.environment_variables()
        for word in re.findall(r"\b[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]+)+\b", row["help"])
    }
    assert quoted, "no help names a class: the check checks nothing"
    assert sorted((name, word) for name, word in quoted if word not in defined) == []
