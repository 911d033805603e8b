"""CPU: the order in which a CUDA capture drops cuBLAS's cached workspaces (pool.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from cuda_graph_runner.backend import pool


@pytest.fixture
def events(monkeypatch):
    log = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: log.append("clear"), raising=False)
    return log


def _ctx(log):
    @contextlib.contextmanager
    def capture():
        log.append("capture_begin")
        try:
            yield
        finally:
            log.append("capture_end")

    return capture()


def test_workspaces_dropped_before_and_after_a_cuda_capture(events):
    with pool.graph_owned_cublas_workspace(_ctx(events), torch.cuda):
        events.append("body")
    assert events == ["clear", "capture_begin", "body", "capture_end", "clear"]


def test_workspaces_dropped_after_a_failed_capture_too(events):
    with pytest.raises(RuntimeError, match="boom"):
        with pool.graph_owned_cublas_workspace(_ctx(events), torch.cuda):
            raise RuntimeError("boom")
    assert events == ["clear", "capture_begin", "capture_end", "clear"]


def test_other_device_modules_get_the_context_unchanged(events):
    ctx = _ctx(events)
    assert pool.graph_owned_cublas_workspace(ctx, object()) is ctx
    with ctx:
        pass
    assert "clear" not in events


def test_clear_is_a_noop_without_cuda(monkeypatch):
    monkeypatch.delattr(torch._C, "_cuda_clearCublasWorkspaces", raising=False)
    pool.clear_cublas_workspaces()  # must not raise on a CPU-only torch


def test_every_cuda_capture_of_a_backend_owns_its_workspace(events, monkeypatch):
    """``BaseCudaGraphBackend.graph_capture`` (every backend's capture: full, breakable's
    segments, tc_piecewise's pieces) wraps ``torch.cuda.graph`` on CUDA, first graph of a
    session and later ones alike."""
    from cuda_graph_runner.backend import BaseCudaGraphBackend

    class _Backend(BaseCudaGraphBackend):
        def capture_one(self, key, forward_fn, post_warmup_hook=None):  # pragma: no cover - unused
            raise NotImplementedError

        def replay(self, key, static_batch):  # pragma: no cover - unused
            raise NotImplementedError

    monkeypatch.setattr(torch.cuda, "graph", lambda graph, **options: _ctx(events), raising=False)
    backend = _Backend("cuda", memory_pool=("pool",), device_module=torch.cuda)
    backend.bind_capture_stream(None)
    for _ in range(2):
        with backend.graph_capture(object()):
            events.append("body")
    assert events == ["clear", "capture_begin", "body", "capture_end", "clear"] * 2
