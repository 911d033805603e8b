"""``model_forward.forward_replaced``: the forward for one block, in the block's thread
only, then exactly what was there; the dispatcher under Dynamo."""

from __future__ import annotations

import threading

import pytest
import torch

from cuda_graph_runner.backend.model_forward import forward_replaced, forward_wrappers, wrap_model_forward

WAIT_S = 30  # a thread that waits longer has lost its partner: the test fails, never hangs


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


def test_a_block_is_seen_by_its_own_thread_only():
    model = _Model()
    inside, checked = threading.Event(), threading.Event()
    seen = {}

    def other_thread() -> None:
        assert inside.wait(WAIT_S)
        seen["other"] = model(torch.tensor(2)).item()
        checked.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with forward_replaced(model, lambda x: x * 10):
        inside.set()
        assert checked.wait(WAIT_S)
        seen["own"] = model(torch.tensor(2)).item()
    thread.join(WAIT_S)
    assert seen == {"other": 3, "own": 20}


def test_blocks_of_two_threads_ending_out_of_order_leave_the_forward_as_written():
    """Thread A opens its block, then B; A ends first. Swapping the attribute, B would put
    A's forward back for good."""
    model = _Model()
    a_open, b_open, a_closed = threading.Event(), threading.Event(), threading.Event()
    seen, errors = {}, []

    def run(name, factor, opened, wait_for, closed=None):
        try:
            with forward_replaced(model, lambda x: x * factor):
                opened.set()
                assert wait_for.wait(WAIT_S)
                seen[name] = model(torch.tensor(2)).item()
            if closed is not None:
                closed.set()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    a = threading.Thread(target=run, args=("a", 10, a_open, b_open, a_closed))
    b = threading.Thread(target=run, args=("b", 100, b_open, a_closed))
    a.start()
    assert a_open.wait(WAIT_S)
    b.start()
    a.join(WAIT_S)
    b.join(WAIT_S)
    assert not errors, errors
    assert seen == {"a": 20, "b": 200}
    assert "forward" not in model.__dict__ and model(torch.tensor(2)).item() == 3


def test_a_block_wins_over_wrappers_and_the_forward_comes_back_after_both():
    model = _Model()
    wrapper = wrap_model_forward(model, lambda x: x * 7, active=lambda: True)
    with forward_replaced(model, lambda x: x * 10):
        assert model(torch.tensor(2)).item() == 20
        wrapper.remove()  # the last wrapper goes while a block is open: the block keeps its forward
        assert model(torch.tensor(2)).item() == 20
    assert "forward" not in model.__dict__ and forward_wrappers(model) == []
    assert model(torch.tensor(2)).item() == 3


def test_dynamo_compiles_the_forward_as_written_through_the_dispatcher():
    """A wrapper's dispatch reads thread-local state through weak references, which Dynamo
    cannot trace (``fullgraph=True`` made it an error); traced, the dispatcher is the
    model's own forward, and ``forward_as_written`` is what backends compile."""

    class Backend:  # bound methods: kept weakly, as a backend's are
        def forward(self, x):
            return x * 7

        def active(self):
            return False

    model, backend = _Model(), Backend()
    wrapper = wrap_model_forward(model, backend.forward, active=backend.active)
    compiled = torch.compile(model.forward, backend="eager", fullgraph=True)
    assert compiled(torch.tensor(2)).item() == 3
    from cuda_graph_runner.backend.model_forward import forward_as_written

    assert forward_as_written(model) == wrapper.original and forward_as_written(model)(torch.tensor(2)).item() == 3
    wrapper.remove()
    assert forward_as_written(model) == model.forward


def test_a_model_with_a_backend_on_it_pickles_with_its_forward_as_written():
    """Dynamo's package cache pickles a compiled forward's model through its bound
    forward, as ``torch.save`` pickles a model: the dispatcher's thread-local state and
    weakly held backends stay behind."""
    import pickle

    model = _Model()
    wrapper = wrap_model_forward(model, lambda x: x * 7, active=lambda: True)
    with forward_replaced(model, lambda x: x * 10):
        copy = pickle.loads(pickle.dumps(model))
    assert copy(torch.tensor(2)).item() == 3
    wrapper.remove()
