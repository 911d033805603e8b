"""Contract verification: a backend class is checked against what the runners call.

Where the check runs (documented in ``registry``): a spec holding a class object is
checked when it registers; a ``"module:Class"`` spec when first resolved or when
``verify`` asks (discovery stays import-free). Either way the failure is recorded on
the entry, so ``list_backends`` shows it and the other backends keep working.
"""

from __future__ import annotations

import contextlib

import pytest
from plugin_sources import RECORDING_BACKEND, PluginDist, install_plugins, minimal_backend_source

from cuda_graph_runner import registry
from cuda_graph_runner.backend import BaseCudaGraphBackend, DisabledBackend
from cuda_graph_runner.backend.errors import BackendContractError
from cuda_graph_runner.backend.hookspecs import BackendSpec
from cuda_graph_runner.testing.conformance import run_python
from cuda_graph_runner.testing.fakes import RecordingBackend


class _Good(DisabledBackend):
    pass


def _variant(**methods):
    """A complete backend with some methods replaced."""
    return type("Variant", (_Good,), methods)


@pytest.mark.parametrize(
    "methods,expected",
    [
        (
            {"capture_one": lambda self, key, forward_fn: None},
            r"Variant\.capture_one\(self, key, forward_fn\) lacks keyword parameter 'post_warmup_hook', which the runners pass",
        ),
        (
            {"capture_one": lambda self, key, forward_fn, *, post_warmup_hook=None, stream_id: None},
            r"Variant\.capture_one\(.*\) requires extra parameter\(s\) \['stream_id'\] the runners never pass",
        ),
        (
            {"replay": lambda self, key, static_batch, graph_id: None},
            r"Variant\.replay\(self, key, static_batch, graph_id\) requires extra parameter\(s\) \['graph_id'\]",
        ),
        (
            {"can_run": lambda self, batch: True},
            r"Variant\.can_run\(self, batch\) takes 1 positional argument\(s\); the runners pass 2 \(batch, key\)",
        ),
        (
            {"capture_one": lambda self, key, forward_fn, post_warmup_hook, /: None},
            r"Variant\.capture_one\(.*\) lacks keyword parameter 'post_warmup_hook'",
        ),
        (
            {"capture_one": lambda self, key, post_warmup_hook, forward_fn=None: None},
            r"capture_one\(.*\) takes 'post_warmup_hook' as positional argument 2, where the runners pass 'forward_fn'",
        ),
        (
            {"cleanup": staticmethod(lambda: None)},
            r"Variant\.cleanup is a staticmethod; the runners call it on the instance",
        ),
        (
            {"__init__": lambda self, device: None},
            r"Variant\.__init__\(self, device\) lacks keyword parameter 'phase'.*lacks keyword parameter 'phase_config'",
        ),
    ],
)
def test_signature_violations_name_class_method_and_parameter(methods, expected):
    with pytest.raises(BackendContractError, match=expected) as info:
        registry.check_backend_class(_variant(**methods), "variant")
    assert str(info.value).startswith("backend 'variant' breaks the backend contract: ")


def test_bare_generator_session_and_async_methods_are_refused():
    def session(self, stream):
        yield

    async def replay(self, key, static_batch):
        return None

    with pytest.raises(BackendContractError) as info:
        registry.check_backend_class(_variant(capture_session=session, replay=replay), "gen")
    msg = str(info.value)
    assert "Variant.capture_session is a bare generator; decorate it with @contextlib.contextmanager" in msg
    assert "Variant.replay is async" in msg
    assert len(info.value.problems) == 2  # every problem, not just the first


def test_missing_abstract_methods_and_non_subclasses():
    class Half(BaseCudaGraphBackend):
        @contextlib.contextmanager
        def capture_session(self, stream):
            yield

    # Plugin API 1.1: the base class implements the sessions, can_run and cleanup.
    with pytest.raises(BackendContractError, match=r"Half does not implement capture_one, replay$"):
        registry.check_backend_class(Half, "half")
    with pytest.raises(
        BackendContractError, match=r"backend 'dict': builtins.dict is not a subclass of BaseCudaGraphBackend"
    ):
        registry.check_backend_class(dict, "dict")


def test_conforming_classes_pass():
    for cls in (
        DisabledBackend,
        RecordingBackend,
        _Good,
        _variant(capture_one=lambda self, *a, **k: None),  # catch-alls accept anything
        _variant(capture_one=lambda self, key, forward_fn, post_warmup_hook=None, extra=1: None),
    ):
        registry.check_backend_class(cls, "ok")


def test_in_process_register_checks_a_class_object_at_once():
    bad = _variant(capture_one=lambda self, key, forward_fn: None)
    with pytest.raises(BackendContractError, match=r"backend 'bad'.*Variant\.capture_one.*post_warmup_hook"):
        registry.register(BackendSpec(name="bad", backend_class=bad, phases=("decode",), devices=("*",)))
    assert "bad" not in registry.get_registry().names()
    registry.register(BackendSpec(name="good", backend_class=_Good, phases=("decode",), devices=("*",)))
    assert {e.name: e for e in registry.list_backends()}["good"].contract == "ok"


def test_in_process_lazy_reference_is_checked_by_verify_and_recorded():
    registry.register(
        BackendSpec(name="lazy_bad", backend_class="collections:OrderedDict", phases=("decode",), devices=("*",))
    )
    registry.register(
        BackendSpec(name="lazy_good", backend_class=RECORDING_BACKEND, phases=("decode",), devices=("*",))
    )
    before = {e.name: e for e in registry.list_backends("cpu")}
    assert before["lazy_bad"].status == "available" and before["lazy_bad"].contract == ""
    row = registry.verify("lazy_bad")
    assert row.status == "failed" and row.contract == "failed"
    assert "collections.OrderedDict is not a subclass of BaseCudaGraphBackend" in row.reason
    after = {e.name: e for e in registry.list_backends("cpu")}
    assert after["lazy_bad"].status == "failed" and after["lazy_bad"].as_row()["contract"] == "failed"
    assert registry.verify("lazy_good").contract == "ok"
    with pytest.raises(BackendContractError, match="lazy_bad.*not a subclass"):
        registry.resolve_decode_backend("lazy_bad", device="cpu")
    assert isinstance(registry.resolve_decode_backend("lazy_good", device="cpu"), RecordingBackend)


# ----------------------------------------------------------------- through installed entry points

CONTRACT_MODULES = {
    "czoo_backends": minimal_backend_source("Fine")
    + """
    class NoHook(Fine):
        def capture_one(self, key, forward_fn):  # no post_warmup_hook
            pass

    class ExtraArg(Fine):
        def replay(self, key, static_batch, stream):
            pass

    class NotABackend:
        pass
""",
    "czoo_plugin": """
        from cuda_graph_runner.backend.hookspecs import BackendSpec, hookimpl

        def _spec(name, cls):
            return BackendSpec(name=name, backend_class=cls, phases=("decode",), devices=("*",), api_version="1.1")

        @hookimpl
        def cuda_graph_runner_backend_specs():
            return [_spec("c_fine", "czoo_backends:Fine"), _spec("c_nohook", "czoo_backends:NoHook"),
                    _spec("c_extra", "czoo_backends:ExtraArg"), _spec("c_notsub", "czoo_backends:NotABackend")]
    """,
    "czoo_eager": """
        from cuda_graph_runner.backend.hookspecs import BackendSpec, hookimpl
        from czoo_backends import NoHook

        @hookimpl
        def cuda_graph_runner_backend_specs():
            # A class object: it is already imported, so it is checked at registration.
            return [BackendSpec(name="c_eager", backend_class=NoHook, phases=("decode",), devices=("*",),
                                api_version="1.1")]
    """,
}
CONTRACT_EPS = {name: "czoo_plugin" for name in ("c_fine", "c_nohook", "c_extra", "c_notsub")} | {
    "c_eager": "czoo_eager"
}


@pytest.fixture(scope="module")
def contract_site(tmp_path_factory):
    return install_plugins(
        tmp_path_factory.mktemp("contract"), PluginDist("cgr-contract-zoo", CONTRACT_MODULES, CONTRACT_EPS)
    )


def test_violations_through_entry_points_are_listed_after_verify(contract_site):
    report = run_python(
        """
        import json, sys
        from cuda_graph_runner import registry
        rows = lambda: {e.name: [e.status, e.reason or "", e.contract] for e in registry.list_backends("cpu")}
        before = rows()
        lazy_import_before_verify = "czoo_backends" in sys.modules and "NoHook" not in str(before["c_eager"])
        checked = {e.name: e.contract for e in registry.verify_all()}
        after = rows()
        try:
            registry.resolve_decode_backend("c_nohook", device="cpu")
            resolved = "no error"
        except Exception as exc:
            resolved = type(exc).__name__ + ": " + str(exc)
        fine = type(registry.resolve_decode_backend("c_fine", device="cpu")).__name__
        print(json.dumps({"before": before, "after": after, "checked": checked, "resolved": resolved, "fine": fine}))
    """,
        pythonpath=[contract_site],
    )
    before, after = report["before"], report["after"]
    # Lazy references: not imported, so not judged, until verified.
    for name in ("c_fine", "c_nohook", "c_extra", "c_notsub"):
        assert before[name][0] == "available" and before[name][2] == "", before[name]
    # A class object was judged at registration.
    assert before["c_eager"][0] == "failed" and before["c_eager"][2] == "failed"
    assert (
        "czoo_backends.NoHook.capture_one(self, key, forward_fn) lacks keyword parameter 'post_warmup_hook'"
        in before["c_eager"][1]
    )
    checked = {k: v for k, v in report["checked"].items() if k.startswith("c_") or k == "disabled"}
    assert checked == {
        "c_eager": "failed",
        "c_extra": "failed",
        "c_fine": "ok",
        "c_nohook": "failed",
        "c_notsub": "failed",
        "disabled": "ok",
    }
    assert (
        "NoHook.capture_one(self, key, forward_fn) lacks keyword parameter 'post_warmup_hook'" in after["c_nohook"][1]
    )
    assert (
        "ExtraArg.replay(self, key, static_batch, stream) requires extra parameter(s) ['stream']" in after["c_extra"][1]
    )
    assert "czoo_backends.NotABackend is not a subclass of BaseCudaGraphBackend" in after["c_notsub"][1]
    assert all(after[n][0] == "failed" for n in ("c_nohook", "c_extra", "c_notsub"))
    assert report["resolved"].startswith("BackendContractError: backend 'c_nohook'")
    assert report["fine"] == "Fine" and after["c_fine"][0] == "available"


def test_first_resolve_checks_and_records(contract_site, monkeypatch):
    monkeypatch.syspath_prepend(str(contract_site))
    registry.reset_registry()
    with pytest.raises(BackendContractError, match=r"ExtraArg\.replay.*\['stream'\]"):
        registry.resolve_decode_backend("c_extra", device="cpu")
    row = {e.name: e for e in registry.list_backends("cpu")}["c_extra"]
    assert row.status == "failed" and "['stream']" in row.reason and isinstance(row.error, BackendContractError)
