"""Shared test fixtures for tests/ and plugins/*/tests. GPU tests are marked ``gpu`` and skipped, with the reason, without CUDA."""

from __future__ import annotations

import os

import pytest

# The CPU bench would otherwise compile the model (tens of seconds) in every test that
# runs it without naming a backend; the tests of that choice turn it back on.
os.environ.setdefault("CUDA_GRAPH_RUNNER_BENCH_CPU_COMPILED", "0")


def pytest_collection_modifyitems(config, items):
    # A real trained model costs minutes on a small CPU: only when asked for (-m real_model).
    if "real_model" not in (config.getoption("markexpr", "") or ""):
        skip_real = pytest.mark.skip(
            reason="converts and runs a real trained model (minutes): run pytest -m real_model"
        )
        for item in items:
            if "real_model" in item.keywords:
                item.add_marker(skip_real)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # torch missing entirely: every GPU test must say so
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: run scripts/gpu_check.sh on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_registry():
    """Each test sees a freshly scanned registry (env vars are read at scan time)."""
    from cuda_graph_runner import registry

    registry.reset_registry(keep_in_process=False)
    yield
    registry.reset_registry(keep_in_process=False)
