"""Packaging and registration of backend ``breakable`` (CPU)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from importlib import metadata

import pytest

from cuda_graph_runner.backend import BackendUnavailableError
from cuda_graph_runner.testing.workload import (
    check_backend_class,
    get_registry,
    list_backends,
    resolve_prefill_backend,
)
from cuda_graph_runner_breakable import plugin


def test_entry_point_names_the_light_registration_module():
    eps = [ep for ep in metadata.entry_points(group="cuda_graph_runner.backends") if ep.name == "breakable"]
    assert [ep.value for ep in eps] == ["cuda_graph_runner_breakable.plugin"]
    assert eps[0].dist.name == "cuda-graph-runner-breakable"


def test_spec_declares_both_phases_on_cuda():
    (spec,) = plugin.cuda_graph_runner_backend_specs()
    assert spec.name == "breakable" and spec.phases == ("decode", "prefill") and spec.devices == ("cuda",)
    assert spec.backend_class == "cuda_graph_runner_breakable.backend:BreakableCudaGraphBackend"
    module, _, attribute = spec.backend_class.partition(":")
    cls = getattr(importlib.import_module(module), attribute)
    check_backend_class(cls, "breakable")


@pytest.mark.parametrize(
    "phase,device,expected",
    [("prefill", "cuda", "breakable"), ("decode", "cuda", None), ("prefill", "npu", None), ("prefill", "cpu", None)],
)
def test_default_backend_hook(phase, device, expected):
    assert plugin.cuda_graph_runner_default_backend(phase=phase, device_type=device) == expected


def test_probe_gives_reasons_off_cuda():
    assert "needs a CUDA device" in plugin.probe("cpu")
    import torch

    if not torch.cuda.is_available():
        assert plugin.probe("cuda")


def test_listed_and_refused_with_reason_without_cuda():
    import torch

    rows = {e.name: e for e in list_backends("cuda")}
    row = rows["breakable"]
    assert row.distribution == "cuda-graph-runner-breakable" and set(row.phases) == {"decode", "prefill"}
    if torch.cuda.is_available():
        assert row.ok
        assert get_registry().default_backend("prefill", "cuda") == "breakable"
    else:
        assert not row.ok and row.reason
        with pytest.raises(BackendUnavailableError, match="breakable"):
            resolve_prefill_backend({"backend": "breakable"}, device="cuda")


def test_registration_module_does_not_import_torch():
    code = (
        "import sys, cuda_graph_runner_breakable.plugin as p; p.cuda_graph_runner_backend_specs(); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
