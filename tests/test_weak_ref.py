"""Non-owning aliases: same memory, no ownership."""

from __future__ import annotations

import torch

from cuda_graph_runner.backend.weak_ref import weak_ref_tensor, weak_ref_tensors


def test_alias_views_the_same_memory_with_the_same_layout():
    base = torch.arange(24.0).reshape(4, 6)
    view = base[1:, ::2]
    alias = weak_ref_tensor(view)
    assert alias.data_ptr() == view.data_ptr()
    assert alias.shape == view.shape and alias.stride() == view.stride() and alias.dtype == view.dtype
    base.mul_(2)  # writes through the owner show in the alias
    torch.testing.assert_close(alias, view)


def test_structures_and_non_tensors():
    t = torch.ones(3)
    out = weak_ref_tensors({"a": (t, 5), "b": [t]})
    assert out["a"][1] == 5 and isinstance(out["a"], tuple) and isinstance(out["b"], list)
    assert out["a"][0].data_ptr() == t.data_ptr() == out["b"][0].data_ptr()
    assert weak_ref_tensor("x") == "x"


def test_alias_does_not_own_the_storage():
    use_count = torch._C._storage_Use_Count
    t = torch.ones(1000)
    before = use_count(t.untyped_storage()._cdata)
    alias = weak_ref_tensor(t)
    assert use_count(t.untyped_storage()._cdata) == before  # the alias adds no owner
    strong = t.view(-1)
    assert use_count(t.untyped_storage()._cdata) == before + 1  # a view does (the check can fail)
    del alias, strong
