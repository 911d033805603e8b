"""Every ``module:attr`` reference in the specs of this repository's plugins resolves.

A probe is only called on the device types a spec lists (CUDA for most), so a missing
name there passes every CPU test and fails every GPU run: resolve the references here.
"""

from __future__ import annotations

import pytest

from cuda_graph_runner.registry import get_registry
from cuda_graph_runner.registry.discovery import load_ref

REPOSITORY_BACKENDS = ("full", "breakable", "tc_piecewise", "npu")


@pytest.mark.parametrize("name", REPOSITORY_BACKENDS)
def test_spec_references_resolve(name):
    entry = {e.name: e for e in get_registry().entries()}[name]
    spec = entry.spec
    assert spec is not None, f"{name}: no spec ({entry.status}: {entry.reason})"
    for field in ("backend_class", "probe"):
        ref = getattr(spec, field)
        if isinstance(ref, str):
            assert callable(load_ref(ref)), f"{name}: {field} {ref!r} does not resolve to a callable"
