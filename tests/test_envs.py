"""One parser for every CUDA_GRAPH_RUNNER_* variable (cuda_graph_runner.backend.envs), and every
reader using it: registry, breakable, tc_piecewise, the CLI's error for a bad value."""

from __future__ import annotations

import re
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


@pytest.mark.parametrize("name,default", [(envs.STRICT_PLUGINS, False), (envs.BREAKABLE_WEAK_REF_ARGS, True)])
@pytest.mark.parametrize("text", [None, "", "  "])
def test_unset_or_empty_boolean_means_its_default(monkeypatch, name, default, text):
    if text is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, text)
    assert envs.get(name) is default


@pytest.mark.parametrize("text", ["2", "maybe", "enable", "y", "truee"])
def test_other_boolean_text_is_an_error_naming_variable_value_and_accepted(monkeypatch, text):
    monkeypatch.setenv(envs.TC_PIECEWISE_DEBUG, text)
    with pytest.raises(
        envs.EnvVarError,
        match=rf"CUDA_GRAPH_RUNNER_TC_PIECEWISE_DEBUG='{text}' is not a boolean; "
        r"accepted: 1/0, true/false, yes/no, on/off",
    ):
        envs.get(envs.TC_PIECEWISE_DEBUG)


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


def test_plugins_read_their_variables_from_the_core_table():
    """This repository's plugins list their variables in the core table (owner: their
    distribution) and read them by its constants; none defines its own."""
    seen = {}
    for plugin in sorted(p for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").is_file()):
        distribution = re.search(r'^name = "([^"]+)"', (plugin / "pyproject.toml").read_text(), re.M).group(1)
        for path in plugin.rglob("*.py"):
            if "tests" in path.parts or ".venv" in path.parts:
                continue
            text = path.read_text()
            assert "envs.define(" not in text and "envs import define" not in text, path
            for name in re.findall(r"\bCUDA_GRAPH_RUNNER_[A-Z][A-Z0-9_]*[A-Z0-9]\b", text):
                seen[name] = (distribution, envs.VARIABLES[name].owner)
    assert seen and all(owner == distribution for distribution, owner in seen.values()), seen


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
