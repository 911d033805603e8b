"""One plugin never breaks the others: whatever loading an entry point raises,
nameless distributions, plugins that use the registry while it loads them, aliases that
must not rename a class, threads, and reset_registry() keeping in-process calls.

Throwaway distributions are pip-installed into private directories, as in
``test_plugin_failures.py``; a METADATA without ``Name`` (pip refuses to build one) is
written by hand.
"""

from __future__ import annotations

import builtins
import sys
import threading

import pytest
from plugin_sources import PluginDist, install_plugins, load_only
from plugin_sources import spec_module as _spec_module

from cuda_graph_runner import registry
from cuda_graph_runner.backend import DisabledBackend
from cuda_graph_runner.backend.errors import RegistryReentryError
from cuda_graph_runner.backend.hookspecs import BackendSpec
from cuda_graph_runner.registry import discovery
from cuda_graph_runner.runner import DecodeCudaGraphRunner
from cuda_graph_runner.testing.fakes import RecordingBackend
from cuda_graph_runner.testing.toy_model import ToyModel

ISO_MODULES = {
    # A lazy loader: any attribute lookup raises ImportError (not AttributeError).
    "iso_lazy": """
        def __getattr__(name):
            raise ImportError("lazy loader: libvendor.so is missing")
    """,
    "iso_exit": "import sys\nsys.exit(3)\n",
    "iso_hook_exit": """
        from cuda_graph_runner.backend.hookspecs import hookimpl

        @hookimpl
        def cuda_graph_runner_backend_specs():
            raise SystemExit("vendor hook gave up")
    """,
    "iso_reentrant": _spec_module(
        "reentrant", before="from cuda_graph_runner import registry\n        registry.list_backends('cpu')"
    ),
    "iso_peek": _spec_module(
        "peek",
        before="""
        from cuda_graph_runner import registry
        from cuda_graph_runner.backend.errors import RegistryReentryError
        try:
            SEEN = sorted(registry.get_registry().names())
        except RegistryReentryError as err:
            SEEN = str(err)
    """,
    ),
    "iso_hook_reentrant": _spec_module(
        "hook_reentrant",
        in_hook="from cuda_graph_runner import registry\n"
        "            registry.resolve_decode_backend('iso_good', device='cpu')",
    ),
    "iso_good": _spec_module("iso_good"),
}
ISO_ENTRY_POINTS = {
    "lazy": "iso_lazy:plugin",
    "exits": "iso_exit",
    "hook_exit": "iso_hook_exit",
    "reentrant": "iso_reentrant",
    "peek": "iso_peek",
    "hook_reentrant": "iso_hook_reentrant",
    "iso_good": "iso_good",
}


@pytest.fixture(scope="module")
def iso_site(tmp_path_factory):
    return install_plugins(
        tmp_path_factory.mktemp("iso"),
        PluginDist("cgr-iso", ISO_MODULES, ISO_ENTRY_POINTS, "1.2.3"),
        PluginDist("cgr-iso-a", {"iso_twin_a": _spec_module("twin")}, {"twin": "iso_twin_a"}),
        PluginDist("cgr-iso-b", {"iso_twin_b": _spec_module("twin")}, {"twin": "iso_twin_b"}),
    )


@pytest.fixture()
def iso(iso_site, monkeypatch):
    monkeypatch.syspath_prepend(str(iso_site))
    for var in (registry.ENV_PLUGINS, registry.ENV_DISABLE_AUTOLOAD, registry.ENV_PREFER, registry.ENV_STRICT):
        monkeypatch.delenv(var, raising=False)
    registry.reset_registry(keep_in_process=False)
    return monkeypatch


@pytest.fixture()
def wellbehaved(iso):
    """Only the plugins that load cleanly, so a test sees its own case and not the others'."""
    iso.setenv(registry.ENV_PLUGINS, "iso_good,cgr-iso-a,cgr-iso-b")
    registry.reset_registry(keep_in_process=False)
    return iso


def _rows():
    return {e.name: e for e in registry.list_backends("cpu")}


def _everything_else_works():
    rows = _rows()  # listing twice: nothing was cached as a scan error
    assert rows["iso_good"].status == "available" and rows["disabled"].status == "available"
    assert registry.resolve_decode_backend("disabled", device="cpu").name == "disabled"
    assert registry.resolve_decode_backend("iso_good", device="cpu").name == "iso_good"
    assert "iso_good" in registry.backend_phases()
    runner = DecodeCudaGraphRunner(ToyModel(), {"decode": {"backend": "disabled", "max_bs": 2}}, device="cpu")
    assert runner.is_disabled


# -- any exception from loading one entry point ------------------------------------------------


def test_lazy_module_getattr_raising_import_error_fails_only_its_plugin(iso):
    row = _rows()["lazy"]
    assert row.status == "failed" and row.distribution == "cgr-iso" and row.version == "1.2.3"
    assert "getting attribute 'plugin' of module 'iso_lazy' raised ImportError: lazy loader" in row.reason
    assert isinstance(row.error, ImportError) and "libvendor.so" in str(row.error)
    _everything_else_works()


def test_sys_exit_at_import_fails_only_its_plugin(iso):
    row = _rows()["exits"]
    assert row.status == "failed"
    assert "import of module 'iso_exit' failed: SystemExit: 3" in row.reason
    assert isinstance(row.error, SystemExit)
    _everything_else_works()


def test_specs_hook_raising_system_exit_fails_only_its_plugin(iso):
    row = _rows()["hook_exit"]
    assert row.status == "failed"
    assert row.reason == "hook cuda_graph_runner_backend_specs raised SystemExit: vendor hook gave up"
    _everything_else_works()


def test_keyboard_interrupt_still_interrupts(iso, monkeypatch):
    real = discovery.importlib.import_module

    def interrupted(name, *args):
        if name == "iso_good":
            raise KeyboardInterrupt
        return real(name, *args)

    monkeypatch.setattr(discovery.importlib, "import_module", interrupted)
    with pytest.raises(KeyboardInterrupt):
        registry.list_backends("cpu")
    with pytest.raises(Exception, match="interrupted.*reset_registry"):  # never a silent half-built registry
        registry.list_backends("cpu")
    monkeypatch.setattr(discovery.importlib, "import_module", real)
    registry.reset_registry()
    assert _rows()["iso_good"].status == "available"


def test_cli_backends_and_config_survive_broken_plugins(iso, capsys):
    from cuda_graph_runner.cli.command import main

    assert main(["backends", "--device-type", "cpu"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "failed" in lines["exits"] and "SystemExit: 3" in lines["exits"]
    assert "failed" in lines["lazy"] and "ImportError" in lines["lazy"]
    assert "available" in lines["iso_good"] and "available" in lines["disabled"]
    assert main(["config"]) == 0
    assert '"config"' in capsys.readouterr().out


# -- a distribution whose METADATA has no Name --------------------------------------------------


@pytest.fixture(scope="module")
def nameless_site(tmp_path_factory):
    site = tmp_path_factory.mktemp("nameless")
    info = site / "nameless_thing-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nVersion: 0.1\nSummary: no Name field\n")
    (info / "entry_points.txt").write_text("[cuda_graph_runner.backends]\nnameless = iso_nameless\n")
    (site / "iso_nameless.py").write_text(_spec_module("nameless").replace("\n        ", "\n"))
    return site


@pytest.mark.parametrize(
    "var,value",
    [
        (registry.ENV_PLUGINS, "nameless,iso_good,cgr-iso-a"),
        (registry.ENV_PREFER, "twin=cgr-iso-a"),
        (registry.ENV_PREFER, "nameless=cgr-iso"),
    ],
)
def test_distribution_without_a_name_is_listed_under_a_placeholder(iso, nameless_site, var, value):
    iso.syspath_prepend(str(nameless_site))
    iso.setenv(var, value)
    registry.reset_registry()
    rows = _rows()
    row = rows["nameless"]
    assert (
        row.distribution.startswith("<unnamed distribution at ") and "nameless_thing-0.1.dist-info" in row.distribution
    )
    assert row.version == "0.1"
    if value.startswith("nameless="):  # the pin names another distribution: honoured, not a TypeError
        assert row.status == "failed" and "asks for nameless=cgr-iso" in row.reason
    else:
        assert row.status == "available", row.reason
    assert rows["iso_good"].status == "available"
    assert registry.resolve_decode_backend("disabled", device="cpu").name == "disabled"


def test_entry_point_enumeration_failure_reads_distributions_one_by_one(iso, monkeypatch):
    def broken(**kwargs):
        raise TypeError("expected string or bytes-like object, got 'NoneType'")

    monkeypatch.setattr(discovery.metadata, "entry_points", broken)
    registry.reset_registry()
    with pytest.warns(RuntimeWarning, match="entry_points\\(\\) raised TypeError"):
        rows = _rows()
    assert rows["iso_good"].status == "available" and rows["twin"].status == "conflict"  # both twins seen


# -- plugins that use the registry while it loads them ------------------------------------------


def test_listing_during_import_is_a_clear_error_not_a_partial_view(iso):
    rows = _rows()
    row = rows["reentrant"]
    assert row.status == "failed"
    assert "RegistryReentryError" in row.reason and "while it is loading plugins" in row.reason
    assert isinstance(row.error, RegistryReentryError)
    assert rows["iso_good"].status == "available"


def test_a_plugin_that_catches_the_reentry_error_saw_no_partial_list(iso):
    rows = _rows()
    assert rows["peek"].status == "available"
    seen = sys.modules["iso_peek"].SEEN
    assert isinstance(seen, str) and "while it is loading plugins" in seen, seen


def test_resolving_from_a_specs_hook_during_the_scan_fails_that_plugin(iso):
    row = _rows()["hook_reentrant"]
    assert row.status == "failed"
    assert row.reason.startswith("hook cuda_graph_runner_backend_specs raised RegistryReentryError")


@pytest.fixture(scope="module")
def extra_site(tmp_path_factory):
    """Two distributions (one pip run) that only the tests naming them in the plugin
    variable load: ``slow`` (its import waits on a gate the test installs) and ``late``."""
    gated = _spec_module("slow", before="import builtins\n        builtins._cgr_iso_gate()")
    return install_plugins(
        tmp_path_factory.mktemp("iso-extra"),
        PluginDist("cgr-iso-slow", {"iso_slow_gate": gated}, {"slow": "iso_slow_gate"}),
        PluginDist("cgr-iso-late", {"iso_late": _spec_module("late")}, {"late": "iso_late"}),
    )


def test_a_thread_asking_during_the_scan_waits_for_the_complete_registry(wellbehaved, extra_site):
    wellbehaved.syspath_prepend(str(extra_site))
    load_only(wellbehaved, "iso_good,cgr-iso-a,cgr-iso-b,slow")
    started, release = threading.Event(), threading.Event()

    def gate():
        started.set()
        release.wait(30)

    wellbehaved.setattr(builtins, "_cgr_iso_gate", gate, raising=False)
    seen = {}
    scanner = threading.Thread(target=lambda: seen.setdefault("scanner", registry.get_registry().names()))
    scanner.start()
    assert started.wait(30)
    other = threading.Thread(target=lambda: seen.setdefault("other", registry.get_registry().names()))
    other.start()
    release.set()
    scanner.join(30)
    other.join(30)
    assert "slow" in seen["other"] and "iso_good" in seen["other"] and "twin" in seen["other"]
    assert seen["other"] == seen["scanner"]


# -- the registry never writes to a plugin's class ----------------------------------------------


def test_an_alias_of_disabled_does_not_rename_existing_disabled_runners(wellbehaved):
    before = DecodeCudaGraphRunner(ToyModel(), {"decode": {"backend": "disabled", "max_bs": 2}}, device="cpu")
    registry.register(
        BackendSpec(name="off", backend_class=DisabledBackend, phases=("decode", "prefill"), devices=("*",))
    )
    alias = DecodeCudaGraphRunner(ToyModel(), {"decode": {"backend": "off", "max_bs": 2}}, device="cpu")
    assert DisabledBackend.name == "disabled"
    assert before.backend.name == "disabled" and before.is_disabled
    assert alias.backend.name == "off" and alias.is_disabled
    assert registry.resolve_decode_backend("disabled", device="cpu").name == "disabled"


def test_two_names_for_one_class_name_each_instance_only(wellbehaved):
    for name in ("rec_a", "rec_b"):
        registry.register(BackendSpec(name=name, backend_class=RecordingBackend, phases=("decode",), devices=("*",)))
    a = registry.resolve_decode_backend("rec_a", device="cpu")
    b = registry.resolve_decode_backend("rec_b", device="cpu")
    good = registry.resolve_decode_backend("iso_good", device="cpu")  # "module:Class" reference, same class
    assert (a.name, b.name, good.name) == ("rec_a", "rec_b", "iso_good")
    assert vars(RecordingBackend)["name"] == "recording"  # the class keeps its own


# -- threads ------------------------------------------------------------------------------------


def test_listing_while_another_thread_registers(wellbehaved):
    registry.get_registry().names()  # scanned
    errors = []
    done = threading.Event()

    def writer():
        try:
            for i in range(400):
                registry.register(
                    BackendSpec(name=f"thr_{i}", backend_class=RecordingBackend, phases=("decode",), devices=("*",))
                )
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            done.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, to hit the race
    try:
        thread = threading.Thread(target=writer)
        thread.start()
        while not done.is_set():
            try:
                registry.backend_phases()
                registry.list_backends("cpu")
                registry.get_registry().names()
                registry.get_registry().default_backend("decode", "cpu")
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                break
        thread.join()
    finally:
        sys.setswitchinterval(old)
    assert errors == []
    assert {f"thr_{i}" for i in range(400)} <= set(registry.backend_phases())


# -- reset_registry() keeps register() and prefer() ------------------------------------------------


def test_reset_keeps_register_and_prefer(wellbehaved):
    registry.register(BackendSpec(name="nb", backend_class=RecordingBackend, phases=("decode",), devices=("*",)))
    assert _rows()["twin"].status == "conflict"  # two distributions claim it
    registry.prefer("twin", "cgr-iso-b")
    registry.reset_registry()  # e.g. after installing a plugin in-process
    rows = _rows()
    assert rows["nb"].status == "available" and rows["nb"].distribution == registry.IN_PROCESS
    assert rows["twin"].status == "available" and rows["twin"].distribution == "cgr-iso-b"
    registry.reset_registry()  # kept again, not only once
    assert "nb" in _rows()
    registry.get_registry().unregister("nb")
    registry.reset_registry()
    assert "nb" not in _rows()
    registry.reset_registry(keep_in_process=False)
    assert _rows()["twin"].status == "conflict"


def test_reset_keeps_calls_made_before_the_registry_was_rescanned(wellbehaved):
    registry.register(BackendSpec(name="nb", backend_class=RecordingBackend, phases=("decode",), devices=("*",)))
    registry.reset_registry()
    registry.reset_registry()  # no use in between: still pending, still kept
    assert "nb" in _rows()


def test_a_kept_registration_conflicting_after_a_rescan_is_dropped_loudly(wellbehaved, extra_site):
    registry.register(BackendSpec(name="late", backend_class=RecordingBackend, phases=("decode",), devices=("*",)))
    wellbehaved.syspath_prepend(str(extra_site))
    load_only(wellbehaved, "iso_good,cgr-iso-a,cgr-iso-b,late")
    with pytest.warns(
        RuntimeWarning,
        match=r"register\('late'\) made before reset_registry\(\) could not be kept.*"
        r"already registered by cgr-iso-late",
    ):
        rows = _rows()
    assert rows["late"].distribution == "cgr-iso-late"
    assert any("could not be kept" in p for p in registry.get_registry().problems)
