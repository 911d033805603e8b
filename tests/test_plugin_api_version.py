"""The plugin API version handshake: a plugin declares the version it implements; a
mismatch makes the backend unavailable with both versions in the reason."""

from __future__ import annotations

import pytest

import cuda_graph_runner.backend.hookspecs as hookspecs
from cuda_graph_runner import registry
from cuda_graph_runner.backend import DisabledBackend
from cuda_graph_runner.backend.errors import BackendUnavailableError
from cuda_graph_runner.backend.hookspecs import PLUGIN_API_VERSION, BackendSpec
from cuda_graph_runner.registry import versions


def _register(name, api_version):
    registry.register(
        BackendSpec(
            name=name, backend_class=DisabledBackend, phases=("decode",), devices=("*",), api_version=api_version
        )
    )


def test_core_exports_its_version():
    from cuda_graph_runner.backend import PLUGIN_API_VERSION as exported

    assert PLUGIN_API_VERSION == "1.3" == exported
    assert hookspecs.BackendSpec(name="x", backend_class="a:B", phases=("decode",)).api_version is None


@pytest.mark.parametrize(
    "declared,expected",
    [
        ("0.9", "implements plugin API 0.9, but this core provides plugin API 1.3"),
        ("2.0", "implements plugin API 2.0, but this core provides plugin API 1.3"),
        ("1.7", "implements plugin API 1.7, newer than the 1.3 this core provides; upgrade cuda-graph-runner"),
        ("one", "declares plugin API version 'one', which is not of the form 'major.minor'"),
        (
            "1.0",
            "implements plugin API 1.0, older than the 1.1 to 1.3 this core runs; to be 1.1, take the capture plan",
        ),
    ],
)
def test_mismatch_is_unavailable_with_both_versions(declared, expected):
    _register("vendor", declared)
    row = {e.name: e for e in registry.list_backends("cpu")}["vendor"]
    assert row.status == "unavailable" and expected in row.reason
    assert row.as_row()["api_version"] == declared
    with pytest.raises(BackendUnavailableError, match="backend 'vendor'.*is unavailable") as info:
        registry.resolve_decode_backend("vendor", device="cpu")
    assert expected in str(info.value)
    # A device probe never overrides the verdict.
    assert {e.name: e for e in registry.list_backends("cuda")}["vendor"].status == "unavailable"


@pytest.mark.parametrize("declared", ["1.1", "1.01", "1.2", "1.3", None])
def test_compatible_or_undeclared_is_available(declared):
    _register("vendor", declared)
    assert {e.name: e for e in registry.list_backends("cpu")}["vendor"].status == "available"
    assert registry.resolve_decode_backend("vendor", device="cpu").name == "vendor"


def test_older_minor_is_compatible(monkeypatch):
    monkeypatch.setattr(versions, "PLUGIN_API_VERSION", "1.3")
    assert versions.api_version_problem("1.1") is None
    assert "newer than the 1.3" in versions.api_version_problem("1.4")


def test_an_older_minor_without_a_note_points_to_the_guide(monkeypatch):
    monkeypatch.setattr(versions, "OLDEST_PLUGIN_API_VERSION", "1.2")
    problem = versions.api_version_problem("1.1")
    assert "older than the 1.2 to 1.3 this core runs; see docs/plugin-authors.md" in problem
