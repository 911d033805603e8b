"""``model_forward.forward_replaced``: the forward for one block, then exactly what was there."""

from __future__ import annotations

import pytest
import torch

from cuda_graph_runner.model_forward import forward_replaced


class _Model(torch.nn.Module):
    def forward(self, x):
        return x + 1


def test_the_class_forward_comes_back_with_no_instance_attribute_left():
    model = _Model()
    with forward_replaced(model, lambda x: x * 10):
        assert model(torch.tensor(2)).item() == 20
    assert "forward" not in model.__dict__
    assert model(torch.tensor(2)).item() == 3


def test_an_instance_forward_comes_back_even_when_the_block_raises():
    model = _Model()
    own = lambda x: x - 1  # noqa: E731 - an instance attribute the user set
    model.forward = own
    with pytest.raises(RuntimeError, match="boom"), forward_replaced(model, lambda x: x * 10):
        raise RuntimeError("boom")
    assert model.__dict__["forward"] is own


def test_an_object_without_instance_dict_is_named():
    with pytest.raises(TypeError, match="int"), forward_replaced(3, lambda: None):
        pass


def test_a_forward_that_is_not_callable_is_named_and_nothing_changes():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="forward must be callable, got None"):
        with forward_replaced(model, None):
            pass
    assert "forward" not in model.__dict__
