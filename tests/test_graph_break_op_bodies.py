"""``marked_op_bodies``: a backend runs another body for a marked op inside a block
(compiled ``full`` gives each op a compiled body per compile size) while the op stays the
same custom op: the body runs with the op's arguments, only inside the block and thread,
blocks nest (adding to the outer block), keys are names or the ops; unknown names, bad
keys, non-callable bodies and bodies that return a value are refused, naming the op."""

from __future__ import annotations

import threading

import pytest
import torch

from cuda_graph_runner.backend.graph_break import marked_op_bodies, register_eager_op


def _op(name: str, value: float):
    def body(output: torch.Tensor, x: torch.Tensor) -> None:
        output.copy_(x + value)

    return register_eager_op(name, body)


ADD_ONE = _op("op_bodies_add_one", 1.0)
ADD_TWO = _op("op_bodies_add_two", 2.0)


def _times_ten(output: torch.Tensor, x: torch.Tensor) -> None:
    output.copy_(x * 10)


def _negate(output: torch.Tensor, x: torch.Tensor) -> None:
    output.copy_(-x)


def test_the_given_body_runs_inside_the_block_only_and_for_its_op_only():
    x, out, other = torch.arange(3.0), torch.empty(3), torch.empty(3)
    with marked_op_bodies({ADD_ONE.name: _times_ten}):
        ADD_ONE(out, x)
        ADD_TWO(other, x)
        torch.ops.cuda_graph_runner.op_bodies_add_one(out, x)  # through the custom op as Dynamo records it
    torch.testing.assert_close(out, x * 10)
    torch.testing.assert_close(other, x + 2)  # not named: its own body
    ADD_ONE(out, x)
    torch.testing.assert_close(out, x + 1)  # outside the block: its own body again


def test_blocks_nest_and_another_thread_keeps_the_op_s_own_body():
    x, out = torch.arange(3.0), torch.empty(3)
    seen = {}

    def in_thread() -> None:
        y = torch.empty(3)
        ADD_ONE(y, x)
        seen["thread"] = y

    with marked_op_bodies({ADD_ONE.name: _times_ten}):
        with marked_op_bodies({ADD_ONE.name: _negate}):
            ADD_ONE(out, x)
            torch.testing.assert_close(out, -x)
            thread = threading.Thread(target=in_thread)
            thread.start()
            thread.join()
        ADD_ONE(out, x)
        torch.testing.assert_close(out, x * 10)
    torch.testing.assert_close(seen["thread"], x + 1)


def test_an_unknown_op_name_is_refused_naming_the_registered_ops():
    with pytest.raises(KeyError, match=r"no marked op named \['no_such_op'\].*op_bodies_add_one"):
        with marked_op_bodies({"no_such_op": _times_ten}):
            pass
    x, out = torch.arange(3.0), torch.empty(3)
    ADD_ONE(out, x)  # nothing was left installed
    torch.testing.assert_close(out, x + 1)


def test_an_inner_block_adds_to_the_outer_one_and_eager_op_keys_are_accepted():
    x, one, two = torch.arange(3.0), torch.empty(3), torch.empty(3)
    with marked_op_bodies({ADD_TWO: _times_ten}):  # the EagerOp as the key
        with marked_op_bodies({ADD_ONE.name: _negate}):
            ADD_ONE(one, x)
            ADD_TWO(two, x)
        torch.testing.assert_close(one, -x)
        torch.testing.assert_close(two, x * 10)  # the outer entry stays inside the inner block
        ADD_ONE(one, x)
    torch.testing.assert_close(one, x + 1)


@pytest.mark.parametrize(
    "bodies,message",
    [
        ({1: _times_ten, "x": _times_ten}, r"key 1 is not a marked op's name; give op.name or the EagerOp"),
        ({ADD_ONE.name: 42}, r"the body for 'op_bodies_add_one' is 42, not a callable"),
        ([(ADD_ONE.name, _times_ten)], r"bodies is \[.*\], not a mapping; give \{op name or EagerOp: body\}"),
        (_times_ten, r"not a mapping"),
    ],
)
def test_a_bad_key_or_body_is_refused_when_the_block_starts(bodies, message):
    with pytest.raises(TypeError, match=message):
        with marked_op_bodies(bodies):
            pass


def test_a_body_returning_a_value_is_an_error_naming_the_op():
    def returns_output(output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        output.copy_(x)
        return output

    x, out = torch.arange(3.0), torch.empty(3)
    with marked_op_bodies({ADD_ONE.name: returns_output}):
        with pytest.raises(TypeError, match=r"body for marked op 'op_bodies_add_one' returned a value.*returns None"):
            ADD_ONE(out, x)
