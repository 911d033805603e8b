"""Conflicting plugins (issue 15, section 1): default claims that do not depend on install
or ``sys.path`` order, one backend name behind two distributions through one module, and
``config`` naming an installed-but-failed or conflicting backend by its cause.

Throwaway distributions are pip-installed into private site directories, each in its own
so a test can choose their order on ``sys.path``; every check runs in a fresh interpreter
(entry points and imported modules are per process).
"""

from __future__ import annotations

import pytest

from cuda_graph_runner.testing.conformance import install_plugin_distributions, run_python, write_plugin_source


def _claiming_module(name: str, *, probe: str = "None", claim: str = "") -> str:
    claim = claim or f'"{name}"'
    return f"""
        import os
        from cuda_graph_runner.backend import DisabledBackend
        from cuda_graph_runner.hookspecs import BackendSpec, DefaultClaim, hookimpl

        class {name.title()}Backend(DisabledBackend):
            pass

        def probe(device_type):
            return {probe}

        @hookimpl
        def cuda_graph_runner_backend_specs():
            return [BackendSpec(name="{name}", backend_class="{name}_plugin:{name.title()}Backend",
                                phases=("decode",), devices=("*",), probe="{name}_plugin:probe",
                                api_version="1.0")]

        @hookimpl
        def cuda_graph_runner_default_backend(phase, device_type):
            return {claim} if (phase, device_type) == ("decode", "cpu") else None
    """


GAMMA = """
    from cuda_graph_runner.backend import DisabledBackend
    from cuda_graph_runner.hookspecs import BackendSpec, hookimpl

    BUILD = "{build}"

    class GammaBackend(DisabledBackend):
        pass

    @hookimpl
    def cuda_graph_runner_backend_specs():
        return [BackendSpec(name="gamma", backend_class="gamma_plugin:GammaBackend", phases=("decode",),
                            devices=("*",), api_version="1.0")]
"""


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    root = tmp_path_factory.mktemp("claims")

    def one(tag, dist, modules, eps, version="1.0.0"):
        src = write_plugin_source(root / f"src-{tag}", dist, modules, eps, version=version)
        return str(install_plugin_distributions(root / f"site-{tag}", src))

    return {
        # usable everywhere, claims the cpu decode default
        "alpha": one("alpha", "cgr-alpha", {"alpha_plugin": _claiming_module("alpha")}, {"alpha": "alpha_plugin"}),
        # claims it too, but its probe says it cannot run here
        "beta": one("beta", "cgr-beta", {"beta_plugin": _claiming_module("beta", probe="'needs a Beta card'")},
                    {"beta": "beta_plugin"}),
        # usable, claims with a priority taken from the environment
        "zeta": one("zeta", "cgr-zeta", {"zeta_plugin": _claiming_module(
            "zeta", claim='DefaultClaim("zeta", priority=int(os.environ.get("ZETA_PRIORITY", "0")))')},
            {"zeta": "zeta_plugin"}),
        # a release and a nightly whose entry points load the same module
        "release": one("release", "cgr-gamma", {"gamma_plugin": GAMMA.format(build="release")},
                       {"gamma": "gamma_plugin"}, version="1.0.0"),
        "nightly": one("nightly", "cgr-gamma-nightly", {"gamma_plugin": GAMMA.format(build="nightly")},
                       {"gamma": "gamma_plugin"}, version="1.1.0.dev1"),
        # installed, but its module fails to import
        "broken": one("broken", "cgr-broken", {"broken_plugin": "raise ImportError('libbroken.so not found')\n"},
                      {"broken": "broken_plugin"}),
    }


DEFAULT_AND_WARNINGS = """
    import json, warnings
    from cuda_graph_runner import registry
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        name = registry.get_registry().default_backend("decode", "cpu")
        again = registry.get_registry().default_backend("decode", "cpu")
    msgs = [str(w.message) for w in caught if "claim the default" in str(w.message)]
    print(json.dumps({"default": name, "again": again, "warnings": msgs}))
"""

def _env(**extra):
    return dict(extra)  # the plugin-filter variables are removed from os.environ below


@pytest.fixture(autouse=True)
def _no_plugin_filter(monkeypatch):
    monkeypatch.delenv("CUDA_GRAPH_RUNNER_PLUGINS", raising=False)
    monkeypatch.delenv("CUDA_GRAPH_RUNNER_PREFER", raising=False)
    monkeypatch.delenv("CUDA_GRAPH_RUNNER_DISABLE_PLUGIN_AUTOLOAD", raising=False)


@pytest.mark.parametrize("order", [("alpha", "beta"), ("beta", "alpha")])
def test_unusable_claim_passes_to_the_next_claimant_in_either_order(sites, order):
    out = run_python(DEFAULT_AND_WARNINGS, pythonpath=[sites[k] for k in order], env=_env())
    assert out["default"] == "alpha" and out["again"] == "alpha"
    assert len(out["warnings"]) == 1  # once, not per call
    text = out["warnings"][0]
    assert text.count("cgr-alpha") == 1 and text.count("cgr-beta") == 1  # every claimant, once
    assert "needs a Beta card" in text


@pytest.mark.parametrize("order", [("alpha", "zeta"), ("zeta", "alpha")])
def test_two_usable_claimants_follow_the_documented_rule(sites, order):
    paths = [sites[k] for k in order]
    # Equal priority: backend name order, so alpha before zeta whatever sys.path says.
    assert run_python(DEFAULT_AND_WARNINGS, pythonpath=paths, env=_env())["default"] == "alpha"
    # A higher priority wins.
    assert run_python(DEFAULT_AND_WARNINGS, pythonpath=paths, env=_env(ZETA_PRIORITY="5"))["default"] == "zeta"


def test_backends_command_shows_who_set_the_default_and_who_else_claimed(sites):
    out = run_python("""
        import contextlib, io, json
        from cuda_graph_runner.cli import main
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = main(["backends", "--device-type", "cpu"])
        with contextlib.redirect_stdout(io.StringIO()) as js:
            main(["backends", "--device-type", "cpu", "--json"])
        rows = {r["name"]: r for r in json.loads(js.getvalue())}
        print(json.dumps({"code": code, "out": buf.getvalue(), "alpha": rows["alpha"], "beta": rows["beta"]}))
    """, pythonpath=[sites["beta"], sites["alpha"]], env=_env())
    assert out["code"] == 0
    line = next(l for l in out["out"].splitlines() if l.startswith("default decode backend on cpu"))
    assert "alpha (set by cgr-alpha)" in line and "also claimed: beta" in line and "cgr-beta" in line
    assert out["alpha"]["default_for"] == "decode" and out["beta"]["claims_default_for"] == "decode"
    assert out["beta"]["default_for"] == ""


def test_release_and_nightly_loading_one_module_are_a_reported_conflict(sites):
    out = run_python("""
        import json
        from cuda_graph_runner import registry
        from cuda_graph_runner.errors import BackendConflictError
        row = {e.name: e for e in registry.list_backends("cpu")}["gamma"]
        try:
            registry.resolve_decode_backend("gamma", device="cpu")
            err = None
        except BackendConflictError as exc:
            err = str(exc)
        print(json.dumps({"status": row.status, "dist": row.distribution, "reason": row.reason, "err": err}))
    """, pythonpath=[sites["nightly"], sites["release"]], env=_env())
    assert out["status"] == "conflict"
    assert "cgr-gamma 1.0.0" in out["dist"] and "cgr-gamma-nightly 1.1.0.dev1" in out["dist"]
    assert "same module" in out["reason"] and "installed by cgr-gamma-nightly" in out["reason"]
    assert "CUDA_GRAPH_RUNNER_PREFER" in out["reason"]
    assert out["err"] is not None and "in conflict" in out["err"]


CONFIG_CLI = """
    import contextlib, io, json, sys
    from cuda_graph_runner.cli import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["config", "--cuda-graph-backend-decode", sys.argv[1] if len(sys.argv) > 1 else "{name}"])
    print(json.dumps({{"code": code, "err": err.getvalue()}}))
"""


def test_config_names_an_installed_but_failed_backend_by_its_cause(sites):
    out = run_python(CONFIG_CLI.format(name="broken"), pythonpath=[sites["broken"]], env=_env())
    assert out["code"] == 2
    assert "installed but failed" in out["err"] and "libbroken.so not found" in out["err"]
    assert "not an installed backend" not in out["err"] and "pip install" not in out["err"]


def test_config_says_how_to_pick_one_of_two_registrations(sites):
    out = run_python(CONFIG_CLI.format(name="gamma"), pythonpath=[sites["nightly"], sites["release"]], env=_env())
    assert out["code"] == 2
    assert "installed twice" in out["err"] and 'CUDA_GRAPH_RUNNER_PREFER="gamma=' in out["err"]
    assert "pip install" not in out["err"]
