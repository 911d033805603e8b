"""The registry package keeps its public surface, one backend-name rule, and the plugin API
version rule (``packaging``-based, but exactly ``major.minor``)."""

from __future__ import annotations

import warnings

import pytest

from cuda_graph_runner import registry
from cuda_graph_runner.backend.hookspecs import BackendSpec
from cuda_graph_runner.config import CudaGraphConfigError, PhaseConfig
from cuda_graph_runner.registry import versions
from cuda_graph_runner.registry.entries import spec_problem

# Every name ``cuda_graph_runner.registry`` serves (names of lower layers behind a
# DeprecationWarning), and the private
# helpers the conformance kit and plugin tests call.
_PUBLIC = """
AVAILABLE CONFLICT CORE_DISTRIBUTION ENTRY_POINT_GROUP ENV_DISABLE_AUTOLOAD ENV_PLUGINS ENV_PREFER
ENV_STRICT FAILED IN_PROCESS PHASES PLUGIN_API_VERSION RUNNER_CALLS UNAVAILABLE WELL_KNOWN_DISTRIBUTIONS
BackendConflictError BackendContractError BackendEntry BackendLoadError BackendRegistry BackendSpec
BackendUnavailableError EntryStatus RegistryReentryError UnknownBackendError api_version_problem backend_phases
backend_problems check_backend_class check_environment conflicts default_device_type environment_variables
get_registry list_backends prefer
register reset_registry resolve_decode_backend resolve_prefill_backend verify verify_all
_load_ref _normalize_dist _spec_problem
""".split()


@pytest.mark.parametrize("name", _PUBLIC)
def test_every_registry_name_resolves(name):
    # Names of lower layers are kept for one release, behind a DeprecationWarning.
    if name in registry._MOVED_NAMES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            assert getattr(registry, name) is not None
    else:
        assert hasattr(registry, name), name


def test_all_lists_only_names_that_exist():
    assert all(hasattr(registry, name) for name in registry.__all__)
    narrowed = {n for n in _PUBLIC if not n.startswith("_")} - set(registry._MOVED_NAMES) - {"conflicts"}
    assert set(registry.__all__) == narrowed


@pytest.mark.parametrize(
    "name", ["full", "_x", "a1", "tc_piecewise", "1full", "a-b", "a.b", "", "é", "a b", "full\n", "Ω"]
)
def test_spec_names_follow_the_config_rule(name):
    # One rule: a name a plugin may register is exactly a name a config can select.
    try:
        PhaseConfig(backend=name)
        config_ok = True
    except CudaGraphConfigError:
        config_ok = False
    spec = BackendSpec(name=name, backend_class="a:B", phases=("decode",))
    assert (spec_problem(spec) is None) == config_ok, name


@pytest.mark.parametrize(
    "declared",
    ["1", "1.0.1", "1.0rc1", "1.0.post1", "1.0+local", "v1.0", " 1.0", "1.0 ", "1!1.0", "1.", ".0", "1.0.dev0", ""],
)
def test_api_version_must_be_major_minor(declared):
    problem = versions.api_version_problem(declared)
    assert problem == f"declares plugin API version {declared!r}, which is not of the form 'major.minor'"


def test_api_version_minors_compare_as_numbers(monkeypatch):
    monkeypatch.setattr(versions, "PLUGIN_API_VERSION", "1.9")
    assert versions.api_version_problem("1.10") == (
        "implements plugin API 1.10, newer than the 1.9 this core provides; upgrade cuda-graph-runner"
    )
    assert versions.api_version_problem("1.09") is None
    assert "older than the 1.1" in versions.api_version_problem("1.0")
    assert "but this core provides plugin API 1.9" in versions.api_version_problem("0.9")
