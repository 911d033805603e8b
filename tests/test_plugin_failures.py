"""Failure reporting: each way a plugin can break is listed with its own message and the
original exception chained, the other backends keep working, and strict mode re-raises.

One throwaway distribution, ``cgr-failure-zoo``, is pip-installed into a private
directory; its entry points each break in one way.
"""

from __future__ import annotations

import functools

import pytest
from plugin_sources import PluginDist, install_plugins, minimal_backend_source, spec_module

from cuda_graph_runner import registry
from cuda_graph_runner.backend.errors import BackendLoadError, BackendUnavailableError
from cuda_graph_runner.testing.conformance import run_python

GOOD_BACKENDS = minimal_backend_source("GoodBackend")
_spec_module = functools.partial(spec_module, backend_class="zoo_backends:GoodBackend")


ZOO_MODULES = {
    "zoo_backends": GOOD_BACKENDS,
    "zoo_import_fails": "raise ImportError('vendor SDK libzoo.so not found')\n",
    "zoo_ok": "'''A module that imports fine but lacks what the entry point names.'''\n",
    "zoo_hook_raises": """
        from cuda_graph_runner.backend.hookspecs import hookimpl

        @hookimpl
        def cuda_graph_runner_backend_specs():
            raise RuntimeError("device table corrupt")
    """,
    "zoo_default_raises": _spec_module(
        "default_raises",
        extra="""
        @hookimpl
        def cuda_graph_runner_default_backend(phase, device_type):
            raise LookupError("no default table for " + device_type)
    """,
    ),
    "zoo_probe_raises": _spec_module(
        "probe_raises",
        extra_spec=', probe="zoo_probe_raises:probe"',
        extra="""
        def probe(device_type):
            raise ValueError("sensor offline")
    """,
    ),
    "zoo_unknown_hook": """
        from cuda_graph_runner.backend.hookspecs import hookimpl

        @hookimpl
        def cuda_graph_runner_backend_spec():  # typo: no such hook
            return []
    """,
    "zoo_class_missing": _spec_module("class_missing", backend_class="zoo_backends:NoSuchBackend"),
    "zoo_wrong_name": _spec_module("other_name"),
    "zoo_bad_spec": _spec_module("bad_spec", phases='"decode"'),
    "zoo_old_api": _spec_module("old_api", api_version="0.3"),
    "zoo_good": _spec_module("good"),
}
ZOO_ENTRY_POINTS = {
    "import_fails": "zoo_import_fails",
    "attr_missing": "zoo_ok:no_such_plugin",
    "hook_raises": "zoo_hook_raises",
    "default_raises": "zoo_default_raises",
    "probe_raises": "zoo_probe_raises",
    "unknown_hook": "zoo_unknown_hook",
    "class_missing": "zoo_class_missing",
    "names_class": "zoo_backends:GoodBackend",
    "wrong_name": "zoo_wrong_name",
    "bad_spec": "zoo_bad_spec",
    "old_api": "zoo_old_api",
    "good": "zoo_good",
}


@pytest.fixture(scope="module")
def zoo_site(tmp_path_factory):
    dist = PluginDist("cgr-failure-zoo", ZOO_MODULES, ZOO_ENTRY_POINTS, "0.4.2")
    return install_plugins(tmp_path_factory.mktemp("zoo"), dist)


@pytest.fixture()
def zoo(zoo_site, monkeypatch):
    """The process registry, scanning with the zoo installed (the real discovery path)."""
    monkeypatch.syspath_prepend(str(zoo_site))
    registry.reset_registry()
    return {e.name: e for e in registry.list_backends("cpu")}


def test_module_that_fails_to_import(zoo):
    row = zoo["import_fails"]
    assert row.status == "failed" and row.distribution == "cgr-failure-zoo" and row.version == "0.4.2"
    assert "entry point import_fails = 'zoo_import_fails'" in row.reason
    assert "import of module 'zoo_import_fails' failed: ImportError: vendor SDK libzoo.so not found" in row.reason
    assert isinstance(row.error, ImportError) and "libzoo.so" in str(row.error)  # the original, not a copy
    with pytest.raises(BackendUnavailableError, match="import_fails.*libzoo.so") as info:
        registry.resolve_decode_backend("import_fails", device="cpu")
    assert info.value.__cause__ is row.error


def test_entry_point_naming_a_missing_attribute(zoo):
    row = zoo["attr_missing"]
    assert row.status == "failed"
    assert "module 'zoo_ok' has no attribute 'no_such_plugin'" in row.reason
    assert isinstance(row.error, AttributeError)


def test_specs_hook_that_raises(zoo):
    row = zoo["hook_raises"]
    assert row.status == "failed"
    assert row.reason == "hook cuda_graph_runner_backend_specs raised RuntimeError: device table corrupt"
    assert isinstance(row.error, RuntimeError)


def test_default_hook_that_raises_fails_its_plugin_not_the_default(zoo):
    assert zoo["default_raises"].status == "available"
    assert registry.get_registry().default_backend("decode", "cpu") == "disabled"  # the others still answer
    row = {e.name: e for e in registry.list_backends("cpu")}["default_raises"]
    assert row.status == "failed"
    assert (
        "hook cuda_graph_runner_default_backend(phase='decode', device_type='cpu') raised "
        "LookupError: no default table for cpu"
    ) in row.reason
    assert isinstance(row.error, LookupError)
    assert registry.get_registry().default_backend("decode", "cpu") == "disabled"  # not called again


def test_probe_that_raises(zoo):
    row = zoo["probe_raises"]
    assert row.status == "failed"
    assert row.reason == "probe zoo_probe_raises:probe('cpu') raised ValueError: sensor offline"
    with pytest.raises(BackendUnavailableError, match="probe_raises.*sensor offline") as info:
        registry.resolve_decode_backend("probe_raises", device="cpu")
    assert isinstance(info.value.__cause__, ValueError)


def test_unknown_hook_is_named(zoo):
    row = zoo["unknown_hook"]
    assert row.status == "failed"
    assert "implements unknown hook(s) ['cuda_graph_runner_backend_spec']" in row.reason
    assert "cuda_graph_runner_backend_specs" in row.reason  # what it should have been


def test_backend_class_reference_to_a_missing_class(zoo):
    assert zoo["class_missing"].status == "available"  # discovery never imports the class
    with pytest.raises(BackendLoadError, match=r"cannot import 'zoo_backends:NoSuchBackend'.*NoSuchBackend") as info:
        registry.resolve_decode_backend("class_missing", device="cpu")
    assert isinstance(info.value.__cause__, AttributeError)
    row = {e.name: e for e in registry.list_backends("cpu")}["class_missing"]
    assert row.status == "failed" and "NoSuchBackend" in row.reason  # recorded for later listings
    with pytest.raises(BackendLoadError, match="NoSuchBackend"):  # and the same error type again
        registry.resolve_decode_backend("class_missing", device="cpu")


def test_entry_point_naming_the_class_instead_of_a_registration_module(zoo):
    row = zoo["names_class"]
    assert row.status == "failed"
    assert "names the backend class GoodBackend" in row.reason and "registration module" in row.reason


def test_entry_point_whose_module_gives_another_name(zoo):
    row = zoo["wrong_name"]
    assert row.status == "failed" and "gave no spec of that name (got ['other_name'])" in row.reason


def test_malformed_spec_is_named(zoo):
    row = zoo["bad_spec"]
    assert row.status == "failed"
    assert "invalid BackendSpec: phases 'decode' must be a non-empty tuple" in row.reason


def test_api_version_mismatch_through_an_entry_point(zoo):
    row = zoo["old_api"]
    assert row.status == "unavailable"
    assert "cgr-failure-zoo 0.4.2 implements plugin API 0.3, but this core provides plugin API 1.3" in row.reason


def test_the_others_still_work(zoo):
    assert zoo["good"].status == "available" and zoo["disabled"].status == "available"
    backend = registry.resolve_decode_backend("good", device="cpu")
    assert type(backend).__name__ == "GoodBackend" and backend.name == "good"
    assert registry.resolve_decode_backend(None, device="cpu").name == "disabled"


STRICT_CASES = [
    (
        "import_fails",
        "BackendLoadError: entry point import_fails = 'zoo_import_fails'",
        "ImportError: vendor SDK libzoo.so",
    ),
    ("attr_missing", "BackendLoadError: entry point attr_missing", "AttributeError"),
    (
        "hook_raises",
        "BackendLoadError: plugin 'hook_raises' of cgr-failure-zoo 0.4.2: hook cuda_graph_runner_backend_specs raised",
        "RuntimeError: device table corrupt",
    ),
    (
        "probe_raises",
        "BackendUnavailableError: backend 'probe_raises' of cgr-failure-zoo: probe",
        "ValueError: sensor offline",
    ),
    ("bad_spec", "BackendLoadError: plugin 'bad_spec' of cgr-failure-zoo 0.4.2: invalid BackendSpec", None),
]


@pytest.fixture(scope="module")
def strict_tracebacks(zoo_site):
    """One fresh interpreter with the strict variable set lists the backends with each
    plugin of :data:`STRICT_CASES` alone; what each listing raised, as its traceback text
    (chained causes included, as an uncaught exception prints them), or None."""
    plugins = [plugin for plugin, _, _ in STRICT_CASES]
    return run_python(
        f"""
        import json, os, traceback
        from cuda_graph_runner import registry
        raised = {{}}
        for plugin in {plugins!r}:
            os.environ[registry.ENV_PLUGINS] = plugin
            registry.reset_registry()
            try:
                registry.list_backends("cpu")
                raised[plugin] = None
            except Exception:
                raised[plugin] = traceback.format_exc()
        print(json.dumps(raised))
        """,
        pythonpath=[zoo_site],
        env={registry.ENV_STRICT: "1"},
    )


@pytest.mark.parametrize("plugin,error,cause", STRICT_CASES)
def test_strict_mode_environment_variable_reraises_with_the_cause(strict_tracebacks, plugin, error, cause):
    text = strict_tracebacks[plugin]
    assert text is not None, f"{plugin}: listing did not raise under strict mode"
    assert error in text, text
    if cause:
        assert "direct cause of the following exception" in text and cause in text, text


def test_strict_flag_reraises_and_keeps_raising(zoo_site, monkeypatch):
    monkeypatch.syspath_prepend(str(zoo_site))
    monkeypatch.setenv(registry.ENV_PLUGINS, "import_fails,good")
    reg = registry.BackendRegistry(strict=True)
    with pytest.raises(BackendLoadError, match="libzoo.so") as info:
        reg.names()
    assert isinstance(info.value.__cause__, ImportError)
    with pytest.raises(BackendLoadError, match="libzoo.so"):
        reg.names()  # a half-built registry is never used silently
    monkeypatch.delenv(registry.ENV_PLUGINS)
    assert "import_fails" in registry.BackendRegistry(strict=False).names()
