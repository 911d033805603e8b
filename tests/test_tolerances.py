"""The testing kit's tolerance per dtype and reduction size (cuda_graph_runner.testing.tolerances)."""

from __future__ import annotations

import pytest
import torch

from cuda_graph_runner.reference.model import PRESETS
from cuda_graph_runner.testing.tolerances import (
    KERNEL_ULPS,
    assert_close,
    assert_kernels_close,
    kernel_tolerance,
    model_tolerance,
    tolerance,
)


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


def _attention(q, k, v, *, exact: bool):
    """Attention of ``q`` over ``k, v`` in bfloat16: SDPA's bf16 kernel, or float32 math
    rounded once (another kernel's accumulation order and rounding points)."""
    if not exact:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    p = (q.float() @ k.float().transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1)
    return (p @ v.float()).to(q.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("context", [3, 17, 512, 2048])
def test_two_attention_kernels_pass_and_a_lost_kv_token_fails(dtype, context):
    g = torch.Generator().manual_seed(context)
    q, k, v = (torch.randn(4, 8, n, 64, generator=g).to(dtype) for n in (2, context, context))
    want = _attention(q, k, v, exact=False)
    assert_kernels_close(_attention(q, k, v, exact=True), want)
    with pytest.raises(AssertionError, match="worst at index"):
        assert_kernels_close(_attention(q, k[:, :, 1:], v[:, :, 1:], exact=True), want)  # one key dropped


def test_bf16_rounding_noise_through_a_deep_computation_passes_with_its_depth():
    # A 2-layer MLP stack plus a head, bf16 (rounded after every op) against float32 rounded
    # once: the whole bf16 noise, more than two bf16 kernels differ by.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 128, generator=g)
    weights = [torch.randn(128, 128, generator=g) * 0.15 for _ in range(3)]
    exact, rounded = x, x.bfloat16()
    for w in weights:
        exact = torch.tanh(exact @ w) * 4 if w is not weights[-1] else exact @ w
        rounded = torch.tanh(rounded @ w.bfloat16()) * 4 if w is not weights[-1] else rounded @ w.bfloat16()
    want = exact.bfloat16()
    assert_kernels_close(rounded, want, depth=3)
    with pytest.raises(AssertionError):
        assert_kernels_close(rounded, want.roll(1, 0), depth=3)  # another row's values


def test_a_small_element_moved_by_the_rounding_of_the_large_ones_passes():
    # Logits of magnitude 6.5; one small logit off by 0.052 (two bf16 attention kernels on an
    # H200): within rounding noise of the large values, yet outside any fixed tolerance
    # picked from the dtype and sizes alone.
    want = torch.linspace(-6.5, 6.5, 1280).view(5, 256).bfloat16()
    want[4, 20] = 0.0742
    got = want.clone()
    got[4, 20] = 0.0221
    fixed = tolerance(torch.bfloat16, 128, depth=3)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, want, **fixed)
    assert_kernels_close(got, want, depth=3)
    got[4, 20] = 0.5  # off by 6% of the largest value: a real mismatch
    with pytest.raises(AssertionError) as info:
        assert_kernels_close(got, want, depth=3, msg="triton EXTEND")
    text = str(info.value)
    assert text.startswith("triton EXTEND: 1 of 1280 elements")
    assert "worst at index (4, 20)" in text and "actual 0.5," in text and "expected 0.0742" in text


def test_kernel_tolerance_scales_with_the_reference_and_the_depth():
    ref = torch.tensor([0.25, -8.0]).bfloat16()
    assert kernel_tolerance(ref) == {"atol": pytest.approx(KERNEL_ULPS * 2**-8 * 8.0), "rtol": 1.6e-2}
    assert kernel_tolerance(ref, depth=3)["atol"] == pytest.approx(3 * kernel_tolerance(ref)["atol"])
    assert kernel_tolerance(ref.half())["rtol"] == 1e-3
    assert kernel_tolerance(torch.zeros(3).bfloat16())["atol"] == 1e-5  # torch's floor: exact zeros stay tight
    # A bf16 model's logits returned in float32: the computing dtype sets the tolerance.
    assert kernel_tolerance(ref.float(), dtype=torch.bfloat16) == kernel_tolerance(ref)
    assert_kernels_close(ref.float() * (1 + 2**-8), ref.float(), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="got float32"):
        kernel_tolerance(ref.float())


@pytest.mark.parametrize(
    "actual,expected,error,match",
    [
        (torch.ones(2).bfloat16(), torch.ones(3).bfloat16(), AssertionError, r"actual \(2,\) torch.bfloat16"),
        (torch.ones(2), torch.ones(2).bfloat16(), AssertionError, "against expected"),
        (torch.ones(2), torch.ones(2), ValueError, "computed in float16 or bfloat16, got float32"),
        (torch.ones(2).bfloat16(), torch.tensor([1.0, float("nan")]).bfloat16(), ValueError, "non-finite"),
    ],
)
def test_bad_comparisons_are_named(actual, expected, error, match):
    with pytest.raises(error, match=match):
        assert_kernels_close(actual, expected)


def test_a_nan_in_the_output_fails():
    want = torch.ones(4).bfloat16()
    with pytest.raises(AssertionError, match=r"worst at index \(2,\): actual nan"):
        assert_kernels_close(torch.tensor([1.0, 1.0, float("nan"), 1.0]).bfloat16(), want)
