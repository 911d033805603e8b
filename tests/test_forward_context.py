"""The forward context: the live batch and a scratch dict private to one forward."""

from __future__ import annotations

import pytest

from cuda_graph_runner.forward_context import forward_context, forward_scratch, get_forward_batch

from toy_model import decode_batch


def test_each_block_has_its_own_scratch_and_batch():
    a, b = decode_batch(1), decode_batch(2)
    with forward_context(a):
        forward_scratch()["meta"] = 1
        with forward_context(b):  # nested: the inner forward sees neither a nor a's scratch
            assert get_forward_batch() is b and "meta" not in forward_scratch()
        assert get_forward_batch() is a and forward_scratch()["meta"] == 1
    with forward_context(a):  # the same batch again is a new forward: nothing carried over
        assert forward_scratch() == {}


def test_outside_any_block_errors_name_the_fix():
    with pytest.raises(RuntimeError, match="forward_context"):
        get_forward_batch()
    with pytest.raises(RuntimeError, match="forward_context"):
        forward_scratch()
