"""``eager_op(..., capture_safe=...)``: how a marked op declares the forward modes in which
it may be recorded into a graph, without any backend.

* accepted forms (bool, a mode, modes, ``ForwardMode`` members, a predicate) and the
  errors for anything else, naming the value and what is accepted;
* ``is_capture_safe`` per batch mode, without a batch, and through a predicate, whose
  host reads stay guarded and whose other errors name the op;
* re-registering an op with another declaration is refused; the default is "never".
"""

from __future__ import annotations

import pytest
import torch

from cuda_graph_runner.backend.context import forward_context
from cuda_graph_runner.backend.errors import CudaGraphHostValueError
from cuda_graph_runner.backend.forward_batch import ForwardBatch, ForwardMode, as_static_batch
from cuda_graph_runner.backend.graph_break import (
    DECODE_LIKE_MODES,
    capture_safe_now,
    eager_op,
    normalize_capture_safe,
    register_eager_op,
)
from cuda_graph_runner.backend.host_guard import SCOPE_OUTSIDE_MARKED_OPS, host_value_guard

D, V, E = ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.EXTEND


def _body() -> object:
    """A fresh annotated body per op (torch infers the custom-op schema from annotations)."""

    def body(output: torch.Tensor) -> None:
        output.zero_()

    return body


def batch(mode: ForwardMode, bs: int = 2) -> ForwardBatch:
    return ForwardBatch(
        forward_mode=mode,
        input_ids=torch.zeros(bs, dtype=torch.int64),
        positions=torch.zeros(bs, dtype=torch.int64),
        out_cache_loc=torch.zeros(bs, dtype=torch.int64),
        req_pool_indices=torch.zeros(bs, dtype=torch.int64),
        seq_lens=torch.ones(bs, dtype=torch.int32),
        seq_lens_cpu=[1] * bs,
    )


@pytest.mark.parametrize(
    "value,expected",
    [
        (False, False),
        (True, True),
        ((), False),
        ("decode", frozenset({D})),
        ("EXTEND", frozenset({E})),
        (D, frozenset({D})),
        (("decode", V), frozenset({D, V})),
        (DECODE_LIKE_MODES, frozenset({D, V})),
        (["extend", "decode", "target_verify"], frozenset({D, V, E})),
    ],
)
def test_accepted_forms(value, expected):
    assert normalize_capture_safe(value) == expected


def test_unknown_mode_and_wrong_type_are_named():
    with pytest.raises(
        ValueError, match=r"'prefill'.*accepted: \['decode', 'target_verify', 'extend', 'dllm_extend'\]"
    ):
        normalize_capture_safe(("decode", "prefill"), "my_op")
    with pytest.raises(TypeError, match=r"my_op.*capture_safe=3 is not accepted"):
        normalize_capture_safe(3, "my_op")
    with pytest.raises(ValueError, match="'prefill'"):
        eager_op("test_cs_bad_mode", capture_safe="prefill")(_body())


@eager_op("test_cs_default")
def default_op(output: torch.Tensor) -> None:
    output.zero_()


@eager_op("test_cs_decode_like", capture_safe=DECODE_LIKE_MODES)
def decode_like_op(output: torch.Tensor) -> None:
    output.zero_()


@eager_op("test_cs_always", capture_safe=True)
def always_op(output: torch.Tensor) -> None:
    output.zero_()


def test_is_capture_safe_per_mode():
    assert default_op.capture_safe is False
    assert [default_op.is_capture_safe(batch(m)) for m in (D, V, E)] == [False] * 3
    assert [decode_like_op.is_capture_safe(batch(m)) for m in (D, V, E)] == [True, True, False]
    assert [always_op.is_capture_safe(batch(m)) for m in (D, V, E)] == [True] * 3
    # Without a batch only an unconditional declaration holds.
    assert not decode_like_op.is_capture_safe(None) and always_op.is_capture_safe(None)
    assert not capture_safe_now(decode_like_op) and capture_safe_now(always_op)
    with forward_context(batch(V)):
        assert capture_safe_now(decode_like_op) and not capture_safe_now(default_op)
    with forward_context(batch(E)):
        assert not capture_safe_now(decode_like_op)


def test_a_predicate_sees_the_batch_and_its_host_reads_stay_guarded():
    small = eager_op("test_cs_small", capture_safe=lambda b: b.batch_size <= 2)(_body())
    assert small.is_capture_safe(batch(D, 2)) and not small.is_capture_safe(batch(D, 3))

    host = eager_op("test_cs_host_pred", capture_safe=lambda b: len(b.seq_lens_cpu) < 4)(_body())
    static = as_static_batch(batch(D))
    assert host.is_capture_safe(static)  # no guard engaged: a plain read
    with host_value_guard("breakable", "decode", SCOPE_OUTSIDE_MARKED_OPS):
        with pytest.raises(CudaGraphHostValueError, match="seq_lens_cpu"):
            host.is_capture_safe(static)

    def broken(b):
        raise KeyError("oops")

    bad = eager_op("test_cs_broken_pred", capture_safe=broken)(_body())
    with pytest.raises(
        RuntimeError,
        match=r"capture_safe predicate of marked op 'cuda_graph_runner::test_cs_broken_pred' "
        r"raised KeyError",
    ) as info:
        bad.is_capture_safe(batch(D))
    assert isinstance(info.value.__cause__, KeyError)


def test_reregistering_with_another_declaration_is_refused():
    def fn(output: torch.Tensor) -> None:
        output.zero_()

    op = register_eager_op("test_cs_rereg", fn, capture_safe="decode")
    assert register_eager_op("test_cs_rereg", fn, capture_safe=[D]) is op  # the same declaration
    with pytest.raises(ValueError, match=r"already registered with capture_safe=.*DECODE.*capture_safe=True"):
        register_eager_op("test_cs_rereg", fn, capture_safe=True)


def test_the_reference_attention_is_capture_safe_in_fixed_width_modes_only():
    from cuda_graph_runner.reference.model import reference_llama_attention

    assert [reference_llama_attention.is_capture_safe(batch(m)) for m in (D, V, E)] == [True, True, False]
