"""Loading controls: which plugins autoload, in-process registration, one cached scan,
and the same discovery in spawned and forked children."""

from __future__ import annotations

import multiprocessing
from importlib import metadata

import pytest
from plugin_sources import PluginDist, install_plugins, load_only, spec_module

from cuda_graph_runner import registry
from cuda_graph_runner.backend.errors import UnknownBackendError
from cuda_graph_runner.backend.hookspecs import BackendSpec
from cuda_graph_runner.registry import discovery
from cuda_graph_runner.testing.conformance import registry_snapshot
from cuda_graph_runner.testing.fakes import RecordingBackend


@pytest.fixture(scope="module")
def ctl_site(tmp_path_factory):
    return install_plugins(
        tmp_path_factory.mktemp("ctl"),
        *(PluginDist(f"cgr-ctl-{x}", {f"ctl_{x}": spec_module(f"ctl_{x}")}, {f"ctl_{x}": f"ctl_{x}"}) for x in "ab"),
    )


@pytest.fixture()
def ctl(ctl_site, monkeypatch):
    monkeypatch.syspath_prepend(str(ctl_site))
    for var in (registry.ENV_PLUGINS, registry.ENV_DISABLE_AUTOLOAD, registry.ENV_PREFER, registry.ENV_STRICT):
        monkeypatch.delenv(var, raising=False)
    registry.reset_registry()
    return monkeypatch


def _names():
    registry.reset_registry()
    return {n for n in registry.get_registry().names() if n.startswith("ctl_") or n == "disabled"}


def test_unset_means_every_plugin(ctl):
    assert _names() == {"ctl_a", "ctl_b", "disabled"}


@pytest.mark.parametrize(
    "value,expected",
    [
        ("ctl_a", {"ctl_a", "disabled"}),  # by backend (entry-point) name
        ("cgr-ctl-b", {"ctl_b", "disabled"}),  # by distribution name
        (" CGR_CTL_B , ctl_a ", {"ctl_a", "ctl_b", "disabled"}),  # normalised, spaces ignored
        ("", {"disabled"}),  # empty: none
    ],
)
def test_plugins_variable_limits_autoload(ctl, value, expected):
    ctl.setenv(registry.ENV_PLUGINS, value)
    assert _names() == expected


def test_plugins_variable_naming_nothing_installed_is_reported(ctl):
    ctl.setenv(registry.ENV_PLUGINS, "ctl_a,ctl_typo")
    with pytest.warns(RuntimeWarning, match=r"'ctl_typo' matches no installed backend or distribution.*'ctl_a'"):
        assert _names() == {"ctl_a", "disabled"}
    assert any("ctl_typo" in p for p in registry.get_registry().problems)


def test_plugins_variable_naming_only_installed_ones_warns_nothing(ctl, recwarn):
    ctl.setenv(registry.ENV_PLUGINS, "ctl_a,cgr-ctl-b")
    _names()
    assert not [w for w in recwarn if "matches no installed" in str(w.message)]


def test_not_loaded_plugin_is_explained_when_asked_for(ctl):
    load_only(ctl, "ctl_a")
    with pytest.raises(
        UnknownBackendError,
        match=r"unknown cuda graph backend 'ctl_b'.*cgr-ctl-b provides 'ctl_b' but "
        r"it was not loaded: CUDA_GRAPH_RUNNER_PLUGINS='ctl_a' does not list it",
    ):
        registry.resolve_decode_backend("ctl_b", device="cpu")


def test_autoload_off(ctl):
    ctl.setenv(registry.ENV_DISABLE_AUTOLOAD, "1")
    assert _names() == {"disabled"}
    with pytest.raises(
        UnknownBackendError,
        match=r"'ctl_a'.*not loaded: plugin autoload is off "
        r"\(CUDA_GRAPH_RUNNER_DISABLE_PLUGIN_AUTOLOAD=1\)",
    ):
        registry.resolve_decode_backend("ctl_a", device="cpu")
    # register() still works: the way tests and notebooks add a backend.
    registry.register(BackendSpec(name="nb", backend_class=RecordingBackend, phases=("decode",), devices=("*",)))
    assert isinstance(registry.resolve_decode_backend("nb", device="cpu"), RecordingBackend)
    ctl.setenv(registry.ENV_DISABLE_AUTOLOAD, "0")
    assert "ctl_a" in _names()


def test_autoload_off_by_constructor(ctl):
    assert registry.BackendRegistry(autoload=False).names() == ["disabled"]


def test_discovery_is_scanned_once_and_cached(ctl):
    calls = []
    real = metadata.entry_points

    def counting(**kwargs):
        calls.append(kwargs)
        return real(**kwargs)

    ctl.setattr(discovery.metadata, "entry_points", counting)
    registry.reset_registry()
    for _ in range(3):
        registry.list_backends("cpu")
        registry.get_registry().names()
        registry.backend_phases()
        registry.resolve_decode_backend("ctl_a", device="cpu")
        registry.get_registry().default_backend("decode", "cpu")
        registry.verify("ctl_b")
    assert calls == [{"group": "cuda_graph_runner.backends"}]
    registry.reset_registry()  # after installing a plugin: rescan
    registry.list_backends("cpu")
    assert len(calls) == 2


def _rows(snapshot):
    return sorted((r["name"], r["distribution"], r["status"]) for r in snapshot)


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_children_discover_the_same(ctl, method):
    if method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"start method {method!r} is not available on this platform")
    load_only(ctl, "ctl_b,full")
    parent = registry_snapshot()
    with multiprocessing.get_context(method).Pool(1) as pool:
        child = pool.apply(registry_snapshot)
    assert child[0]["pid"] != parent[0]["pid"]
    assert _rows(child) == _rows(parent)
    assert "ctl_b" in {r["name"] for r in child} and "ctl_a" not in {r["name"] for r in child}


@pytest.mark.parametrize("method,inherits", [("spawn", False), ("fork", True)])
def test_in_process_registration_reaches_forked_children_only(ctl, method, inherits):
    if method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"start method {method!r} is not available on this platform")
    registry.register(BackendSpec(name="nb_only", backend_class=RecordingBackend, phases=("decode",), devices=("*",)))
    with multiprocessing.get_context(method).Pool(1) as pool:
        child = pool.apply(registry_snapshot)
    assert ("nb_only" in {r["name"] for r in child}) is inherits
    assert "ctl_a" in {r["name"] for r in child}  # both scan the installed plugins
