"""Conflicting plugins: default claims that do not depend on install
or ``sys.path`` order, one backend name behind two distributions through one module, and
``config`` naming an installed-but-failed or conflicting backend by its cause.

Throwaway distributions are pip-installed into private site directories, each in its own
so a test can choose their order on ``sys.path``. Checks run in this process: entry points
are read from ``sys.path`` at each registry scan, and the fixture ``on_path`` removes the
plugins' modules from ``sys.modules`` afterwards, so each check sees only its sites.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import warnings

import pytest
from plugin_sources import PluginDist, install_plugins

from cuda_graph_runner import registry
from cuda_graph_runner.backend.errors import BackendConflictError
from cuda_graph_runner.cli.command import main

PLUGIN_MODULES = ("alpha_plugin", "beta_plugin", "zeta_plugin", "gamma_plugin", "broken_plugin")


def _claiming_module(name: str, *, probe: str = "None", claim: str = "") -> str:
    claim = claim or f'"{name}"'
    return f"""
        import os
        from cuda_graph_runner.backend import DisabledBackend
        from cuda_graph_runner.backend.hookspecs import BackendSpec, DefaultClaim, hookimpl

        class {name.title()}Backend(DisabledBackend):
            pass

        def probe(device_type):
            return {probe}

        @hookimpl
        def cuda_graph_runner_backend_specs():
            return [BackendSpec(name="{name}", backend_class="{name}_plugin:{name.title()}Backend",
                                phases=("decode",), devices=("*",), probe="{name}_plugin:probe",
                                api_version="1.1")]

        @hookimpl
        def cuda_graph_runner_default_backend(phase, device_type):
            return {claim} if (phase, device_type) == ("decode", "cpu") else None
    """


GAMMA = """
    from cuda_graph_runner.backend import DisabledBackend
    from cuda_graph_runner.backend.hookspecs import BackendSpec, hookimpl

    BUILD = "{build}"

    class GammaBackend(DisabledBackend):
        pass

    @hookimpl
    def cuda_graph_runner_backend_specs():
        return [BackendSpec(name="gamma", backend_class="gamma_plugin:GammaBackend", phases=("decode",),
                            devices=("*",), api_version="1.1")]
"""


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    root = tmp_path_factory.mktemp("claims")

    def one(tag, dist, backend, source, version="1.0.0"):
        """A site holding distribution ``dist``: module ``<backend>_plugin``, entry point ``backend``."""
        module = f"{backend}_plugin"
        return str(install_plugins(root / tag, PluginDist(dist, {module: source}, {backend: module}, version)))

    zeta_claim = 'DefaultClaim("zeta", priority=int(os.environ.get("ZETA_PRIORITY", "0")))'
    return {
        # usable everywhere, claims the cpu decode default
        "alpha": one("alpha", "cgr-alpha", "alpha", _claiming_module("alpha")),
        # claims it too, but its probe says it cannot run here
        "beta": one("beta", "cgr-beta", "beta", _claiming_module("beta", probe="'needs a Beta card'")),
        # usable, claims with a priority taken from the environment
        "zeta": one("zeta", "cgr-zeta", "zeta", _claiming_module("zeta", claim=zeta_claim)),
        # a release and a nightly whose entry points load the same module
        **{
            build: one(build, dist, "gamma", GAMMA.format(build=build), version)
            for build, dist, version in (
                ("release", "cgr-gamma", "1.0.0"),
                ("nightly", "cgr-gamma-nightly", "1.1.0.dev1"),
            )
        },
        # installed, but its module fails to import
        "broken": one("broken", "cgr-broken", "broken", "raise ImportError('libbroken.so not found')\n"),
    }


@pytest.fixture(autouse=True)
def _no_plugin_filter(monkeypatch):
    monkeypatch.delenv("CUDA_GRAPH_RUNNER_PLUGINS", raising=False)
    monkeypatch.delenv("CUDA_GRAPH_RUNNER_PREFER", raising=False)
    monkeypatch.delenv("CUDA_GRAPH_RUNNER_DISABLE_PLUGIN_AUTOLOAD", raising=False)


@pytest.fixture()
def on_path(sites, monkeypatch):
    """``on_path("a", "b")``: sites a then b first on ``sys.path`` (as ``PYTHONPATH=a:b``),
    a freshly scanned registry; the plugins' modules are forgotten after the test."""

    def put(*order):
        for key in reversed(order):
            monkeypatch.syspath_prepend(sites[key])
        registry.reset_registry(keep_in_process=False)

    yield put
    for name in PLUGIN_MODULES:
        sys.modules.pop(name, None)


def _default_and_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        name = registry.get_registry().default_backend("decode", "cpu")
        again = registry.get_registry().default_backend("decode", "cpu")
    msgs = [str(w.message) for w in caught if "claim the default" in str(w.message)]
    return {"default": name, "again": again, "warnings": msgs}


@pytest.mark.parametrize("order", [("alpha", "beta"), ("beta", "alpha")])
def test_unusable_claim_passes_to_the_next_claimant_in_either_order(on_path, order):
    on_path(*order)
    out = _default_and_warnings()
    assert out["default"] == "alpha" and out["again"] == "alpha"
    assert len(out["warnings"]) == 1  # once, not per call
    text = out["warnings"][0]
    assert text.count("cgr-alpha") == 1 and text.count("cgr-beta") == 1  # every claimant, once
    assert "needs a Beta card" in text


@pytest.mark.parametrize("order", [("alpha", "zeta"), ("zeta", "alpha")])
def test_two_usable_claimants_follow_the_documented_rule(on_path, monkeypatch, order):
    on_path(*order)
    # Equal priority: backend name order, so alpha before zeta whatever sys.path says.
    assert _default_and_warnings()["default"] == "alpha"
    # A higher priority wins (the claim reads the variable when the registry scans).
    monkeypatch.setenv("ZETA_PRIORITY", "5")
    registry.reset_registry(keep_in_process=False)
    assert _default_and_warnings()["default"] == "zeta"


@pytest.mark.filterwarnings("ignore:several plugins claim the default")  # the subject of the test above
def test_backends_command_shows_who_set_the_default_and_who_else_claimed(on_path, capsys):
    on_path("beta", "alpha")
    code = main(["backends", "--device-type", "cpu"])
    out = capsys.readouterr().out
    main(["backends", "--device-type", "cpu", "--json"])
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert code == 0
    line = next(l for l in out.splitlines() if l.startswith("default decode backend on cpu"))
    assert "alpha (set by cgr-alpha)" in line and "also claimed: beta" in line and "cgr-beta" in line
    assert rows["alpha"]["default_for"] == "decode" and rows["beta"]["claims_default_for"] == "decode"
    assert rows["beta"]["default_for"] == ""


def test_release_and_nightly_loading_one_module_are_a_reported_conflict(on_path):
    on_path("nightly", "release")
    row = {e.name: e for e in registry.list_backends("cpu")}["gamma"]
    assert row.status == "conflict"
    assert "cgr-gamma 1.0.0" in row.distribution and "cgr-gamma-nightly 1.1.0.dev1" in row.distribution
    assert "same module" in row.reason and "installed by cgr-gamma-nightly" in row.reason
    assert "CUDA_GRAPH_RUNNER_PREFER" in row.reason
    with pytest.raises(BackendConflictError, match="in conflict"):
        registry.resolve_decode_backend("gamma", device="cpu")


def _config_cli(name):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["config", "--cuda-graph-backend-decode", name])
    return code, err.getvalue()


def test_config_names_an_installed_but_failed_backend_by_its_cause(on_path):
    on_path("broken")
    code, err = _config_cli("broken")
    assert code == 2
    assert "installed but failed" in err and "libbroken.so not found" in err
    assert "not an installed backend" not in err and "pip install" not in err


def test_config_says_how_to_pick_one_of_two_registrations(on_path):
    on_path("nightly", "release")
    code, err = _config_cli("gamma")
    assert code == 2
    assert "installed twice" in err and 'CUDA_GRAPH_RUNNER_PREFER="gamma=' in err
    assert "pip install" not in err
