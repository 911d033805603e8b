"""The shared graph memory pool: kept alive by a ``MemPool`` on CUDA, given back when no
graph uses it (CPU: a stand-in ``MemPool`` on the real ``torch.cuda`` module)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from cuda_graph_runner.backend import pool


class _FakeMemPool:
    """Counts references like the allocator does: one for the MemPool itself, one per graph."""

    made = 0

    def __init__(self) -> None:
        type(self).made += 1
        self.id = (0, type(self).made)
        self.graphs = 0

    def use_count(self) -> int:
        return 1 + self.graphs


@pytest.fixture
def fake_mem_pool(monkeypatch):
    monkeypatch.setattr(torch.cuda, "MemPool", _FakeMemPool, raising=False)
    monkeypatch.setattr(torch.cuda, "device", lambda _d: contextlib.nullcontext())
    pool.reset_global_graph_memory_pools()
    yield
    pool.reset_global_graph_memory_pools()


def test_cuda_pool_is_a_mem_pool_kept_until_no_graph_uses_it(fake_mem_pool):
    handle = pool.get_global_graph_memory_pool("cuda:0")
    mem_pool = pool._mem_pools["cuda:0"]
    assert handle == mem_pool.id
    assert pool.get_global_graph_memory_pool("cuda:0") == handle  # shared, not made again

    mem_pool.graphs = 2  # graphs captured into it are alive: keep it
    assert pool.release_unused_graph_memory_pool("cuda:0") is False
    assert pool.get_global_graph_memory_pool("cuda:0") == handle

    mem_pool.graphs = 0  # every graph destroyed: give it back; the next capture gets a new pool
    assert pool.release_unused_graph_memory_pool("cuda:0") is True
    assert pool.get_global_graph_memory_pool("cuda:0") != handle
    assert pool.release_unused_graph_memory_pool("cuda:1") is False  # never made: nothing to do


def test_pool_without_mem_pool_is_a_plain_handle_never_released():
    from cuda_graph_runner.testing.fakes import FakeGraphDeviceModule

    module = FakeGraphDeviceModule()
    pool.reset_global_graph_memory_pools()
    try:
        handle = pool.get_global_graph_memory_pool("cuda:0", module)
        assert ("graph_pool_handle",) in module.events
        assert pool.release_unused_graph_memory_pool("cuda:0", module) is False
        assert pool.get_global_graph_memory_pool("cuda:0", module) == handle
    finally:
        pool.reset_global_graph_memory_pools()
