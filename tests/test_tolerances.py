"""The testing kit's tolerance per dtype and reduction size (cuda_graph_runner.testing.tolerances)."""

from __future__ import annotations

import pytest
import torch

from cuda_graph_runner.reference.model import PRESETS
from cuda_graph_runner.testing.tolerances import assert_close, model_tolerance, tolerance


def test_tolerance_grows_with_dtype_reduction_and_depth():
    f32 = tolerance(torch.float32, 64)["atol"]
    assert tolerance("float32", 64) == tolerance(torch.float32, 64)
    assert tolerance(torch.float32, 256)["atol"] > f32 and tolerance(torch.float32, 64, depth=3)[
        "atol"
    ] == pytest.approx(3 * f32)
    assert tolerance(torch.bfloat16, 64)["atol"] > tolerance(torch.float16, 64)["atol"] > f32
    assert tolerance(torch.float64, 64)["atol"] < 1e-12
    tiny = model_tolerance(PRESETS["tiny"], torch.float32, context_len=48)
    assert tiny == tolerance(torch.float32, 128, depth=3)  # intermediate size 128, 2 layers + LM head
    assert 1.25e-6 * 10 < tiny["atol"] < 1e-4  # the difference seen on an AMD EPYC, with a wide margin


@pytest.mark.parametrize("bad,match", [((torch.int32, 4), "no tolerance for dtype"), ((torch.float32, 0), ">= 1")])
def test_bad_arguments_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        tolerance(*bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [8, 128, 4096])
def test_another_summation_order_passes_and_a_wrong_sum_fails(dtype, k):
    g = torch.Generator().manual_seed(k)
    a = torch.randn(64, k, generator=g).to(dtype)
    b = torch.randn(k, 32, generator=g).to(dtype)
    whole = (a.float() @ b.float()).to(dtype)
    # Same products, summed in other orders: two halves, and reversed blocks of 8.
    halves = (a[:, : k // 2].float() @ b[: k // 2].float() + a[:, k // 2 :].float() @ b[k // 2 :].float()).to(dtype)
    blocks = sum(a[:, i : i + 8].float() @ b[i : i + 8].float() for i in reversed(range(0, k, 8))).to(dtype)
    assert_close(halves, whole, reduction_size=k)
    assert_close(blocks, whole, reduction_size=k)
    wrong = (a[:, 1:].float() @ b[1:].float()).to(dtype)  # one term lost, as a padding bug would
    with pytest.raises(AssertionError):
        assert_close(wrong, whole, reduction_size=k)
