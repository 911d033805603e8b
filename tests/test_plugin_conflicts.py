"""Name collisions: two distributions register backend ``dup``. The error names both;
``prefer()`` or ``CUDA_GRAPH_RUNNER_PREFER`` chooses one explicitly."""

from __future__ import annotations

import pytest

from cuda_graph_runner import registry
from cuda_graph_runner.backend.errors import BackendConflictError, BackendUnavailableError, UnknownBackendError
from cuda_graph_runner.testing.conformance import install_plugin_distributions, run_python, write_plugin_source


def _dup_module(cls_name: str) -> str:
    module = cls_name.lower()
    return f"""
        from cuda_graph_runner.backend import DisabledBackend
        from cuda_graph_runner.backend.hookspecs import BackendSpec, hookimpl

        class {cls_name}(DisabledBackend):
            pass

        @hookimpl
        def cuda_graph_runner_backend_specs():
            return [BackendSpec(name="dup", backend_class="{module}:{cls_name}", phases=("decode",), devices=("*",),
                                api_version="1.1")]
    """


@pytest.fixture(scope="module")
def dup_site(tmp_path_factory):
    root = tmp_path_factory.mktemp("dup")
    one = write_plugin_source(
        root / "one", "cgr-dup-one", {"dupone": _dup_module("DupOne")}, {"dup": "dupone"}, version="1.0.0"
    )
    two = write_plugin_source(
        root / "two", "Cgr_Dup.Two", {"duptwo": _dup_module("DupTwo")}, {"dup": "duptwo"}, version="2.0.0"
    )
    return install_plugin_distributions(root / "site", one, two)


@pytest.fixture()
def with_dups(dup_site, monkeypatch):
    monkeypatch.syspath_prepend(str(dup_site))
    monkeypatch.delenv(registry.ENV_PREFER, raising=False)
    registry.reset_registry()


def test_collision_names_both_distributions(with_dups):
    row = {e.name: e for e in registry.list_backends("cpu")}["dup"]
    assert row.status == "conflict"
    assert "backend name 'dup' is registered by several distributions" in row.reason
    assert "cgr-dup-one 1.0.0" in row.reason and "2.0.0" in row.reason and "Dup" in row.distribution
    assert 'CUDA_GRAPH_RUNNER_PREFER="dup=cgr-dup-one"' in row.reason and "prefer('dup', 'cgr-dup-one')" in row.reason
    with pytest.raises(BackendConflictError, match=r"'dup'.*cgr-dup-one 1\.0\.0.*2\.0\.0") as info:
        registry.resolve_decode_backend("dup", device="cpu")
    assert isinstance(info.value.__cause__, BackendConflictError)
    assert registry.resolve_decode_backend("disabled", device="cpu").name == "disabled"  # others unaffected


def test_prefer_chooses_one_distribution(with_dups):
    registry.prefer("dup", "cgr-dup-two")  # normalised: matches "Cgr_Dup.Two"
    assert type(registry.resolve_decode_backend("dup", device="cpu")).__name__ == "DupTwo"
    registry.prefer("dup", "cgr-dup-one")
    assert type(registry.resolve_decode_backend("dup", device="cpu")).__name__ == "DupOne"
    with pytest.raises(
        UnknownBackendError,
        match=r"no distribution 'cgr-dup-three' registers backend 'dup' "
        r"\(found: cgr-dup-one, Cgr_Dup.Two\)",
    ):
        registry.prefer("dup", "cgr-dup-three")


@pytest.mark.parametrize("dist,cls", [("cgr-dup-one", "DupOne"), ("cgr_dup_two", "DupTwo")])
def test_prefer_environment_variable(with_dups, monkeypatch, dist, cls):
    monkeypatch.setenv(registry.ENV_PREFER, f"other=x=y, dup={dist}")
    registry.reset_registry()
    with pytest.warns(RuntimeWarning, match="CUDA_GRAPH_RUNNER_PREFER: no installed plugin registers backend 'other'"):
        rows = {e.name: e for e in registry.list_backends("cpu")}
    assert rows["dup"].status == "available"
    assert type(registry.resolve_decode_backend("dup", device="cpu")).__name__ == cls


def test_prefer_environment_variable_naming_no_provider_is_reported(with_dups, monkeypatch):
    monkeypatch.setenv(registry.ENV_PREFER, "dup=cgr-dup-three")
    registry.reset_registry()
    row = {e.name: e for e in registry.list_backends("cpu")}["dup"]
    assert row.status == "failed"
    assert "CUDA_GRAPH_RUNNER_PREFER asks for dup=cgr-dup-three, but no distribution 'cgr-dup-three'" in row.reason
    with pytest.raises(BackendUnavailableError, match="cgr-dup-three"):
        registry.resolve_decode_backend("dup", device="cpu")


def test_malformed_prefer_is_warned_and_strict_raises(with_dups, monkeypatch):
    monkeypatch.setenv(registry.ENV_PREFER, "dup")
    registry.reset_registry()
    with pytest.warns(RuntimeWarning, match="'dup' is not of the form name=distribution"):
        registry.get_registry().names()
    assert registry.get_registry().problems == ["CUDA_GRAPH_RUNNER_PREFER: 'dup' is not of the form name=distribution"]
    with pytest.raises(ValueError, match="not of the form name=distribution"):
        registry.BackendRegistry(strict=True).names()


def test_prefer_in_a_fresh_process(dup_site):
    out = run_python(
        """
        import json
        from cuda_graph_runner import registry
        b = registry.resolve_decode_backend("dup", device="cpu")
        print(json.dumps({"cls": type(b).__name__, "dist": {e.name: e.distribution for e in registry.list_backends()}["dup"]}))
    """,
        pythonpath=[dup_site],
        env={registry.ENV_PREFER: "dup=cgr-dup-two"},
    )
    assert out == {"cls": "DupTwo", "dist": "Cgr_Dup.Two"}


def test_backends_lists_a_conflict_and_check_fails_on_it(with_dups, capsys):
    from cuda_graph_runner.cli.command import main

    assert main(["backends", "--device-type", "cpu"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("dup "))
    assert "conflict" in line and "cgr-dup-one" in line and "CUDA_GRAPH_RUNNER_PREFER" in line
    assert main(["backends", "--check"]) == 1
