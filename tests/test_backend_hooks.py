"""``hookspecs.backend_hooks``: the two hooks of a one-backend plugin, as pluggy sees them."""

from __future__ import annotations

import types

import pluggy
import pytest

from cuda_graph_runner.backend.hookspecs import PROJECT_NAME, BackendHookSpecs, BackendSpec, backend_hooks

SPEC = BackendSpec(name="acme", backend_class="acme_cgr.backend:X", phases=("decode",), devices=("*",))


def _module(**hooks):
    """A registration module holding ``hooks`` under their hook names, as a plugin binds them."""
    return types.SimpleNamespace(**hooks)


def test_hooks_register_with_pluggy_and_answer_for_the_declared_pairs():
    specs, default = backend_hooks(SPEC, default_for=[("decode", "acme")])
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(BackendHookSpecs)
    pm.register(_module(cuda_graph_runner_backend_specs=specs, cuda_graph_runner_default_backend=default), name="acme")
    assert pm.hook.cuda_graph_runner_backend_specs() == [[SPEC]]
    assert pm.hook.cuda_graph_runner_default_backend(phase="decode", device_type="acme") == "acme"
    assert pm.hook.cuda_graph_runner_default_backend(phase="decode", device_type="cuda") is None


def test_no_default_for_never_claims():
    _, default = backend_hooks(SPEC)
    assert default(phase="decode", device_type="cuda") is None


@pytest.mark.parametrize(
    "pair,match",
    [
        (("prefill", "cuda"), "names phase 'prefill'"),
        ("decode", "not a \\(phase, device_type\\) pair"),
    ],
)
def test_a_bad_default_for_entry_is_named(pair, match):
    with pytest.raises(ValueError, match=match):
        backend_hooks(SPEC, default_for=[pair])


def test_a_default_for_device_the_spec_does_not_list_is_named():
    spec = BackendSpec(name="acme", backend_class="acme_cgr.backend:X", phases=("decode",), devices=("cuda",))
    with pytest.raises(ValueError, match="names device type 'npu'; the spec's devices are"):
        backend_hooks(spec, default_for=[("decode", "npu")])


@pytest.mark.parametrize("default_for", [None, "decode", ("decode", "cuda")])
def test_default_for_that_is_not_a_list_of_pairs_is_named(default_for):
    with pytest.raises(ValueError, match=r"default_for must be a list of \(phase, device_type\) pairs"):
        backend_hooks(SPEC, default_for=default_for)


def test_a_pair_written_as_a_list_is_accepted():
    _, default = backend_hooks(SPEC, default_for=[["decode", "cuda"]])
    assert default(phase="decode", device_type="cuda") == "acme"
