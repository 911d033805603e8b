"""Tolerances for comparing float results computed at different batch shapes or orders.

A graph replayed at a padded batch size, a batch of another shape, a chunked prefill or
another kernel (a different blocking of the same GEMM) sums the same terms in another
order. The results then differ in the last bits, by an amount that depends on the CPU or
GPU (its vector width, the library's blocking), not on our code: ``atol=1e-6, rtol=0``
passed on one x86 CPU and failed by 1.25e-6 on another. Exact equality, or a tolerance
picked on one machine, is therefore wrong for such comparisons; a wrong result (a stale
graph, a padded row leaking into a real one) differs by orders of magnitude more.

The bound used here (the usual floating-point summation analysis, as in Higham,
*Accuracy and Stability of Numerical Algorithms*, ch. 3; PyTorch's own
``torch.testing`` defaults scale with the dtype the same way):

    tol = depth * (ROUNDING * eps(dtype) + ORDER * sqrt(reduction_size) * eps(accumulate))

* ``eps(dtype)``: the output rounding of each op in ``dtype``;
* ``sqrt(reduction_size) * eps(accumulate)``: the statistical growth of the rounding error
  of a sum of ``reduction_size`` terms accumulated in ``accumulate`` (float32 for the
  16-bit types, as CPU and GPU kernels do; the dtype itself otherwise);
* ``depth``: how many such reductions the difference passes through (layers).

The same value is used for ``atol`` and ``rtol`` (logits of the reference models are of
order one). Results computed the same way on the same shapes (a copy, the same kernel
called twice) are still compared exactly, and are not what this module is for.

Two *different kernels* in a 16-bit dtype (the ``triton`` or ``flashinfer`` attention
against the ``torch`` one) differ by more: each rounds its intermediates to the dtype at
other points, so an element's difference is a few units of rounding of the *largest*
values it was computed from, not of its own value, and a fixed ``atol`` fails on the
element that happens to be small. :func:`kernel_tolerance` and
:func:`assert_kernels_close` scale ``atol`` with ``max |expected|`` instead.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

#: Multiples of eps, chosen so the bound holds with a wide margin on every CPU and GPU we
#: run on (the worst difference seen, 1.25e-6 on an AMD EPYC, is ~15x below it).
ROUNDING = 2.0
ORDER = 8.0

_EPS = {  # torch.finfo(dtype).eps, spelled out so this module imports without torch
    "float64": 2.220446049250313e-16,
    "float32": 1.1920928955078125e-07,
    "float16": 0.0009765625,
    "bfloat16": 0.0078125,
}
_ACCUMULATE = {"float64": "float64", "float32": "float32", "float16": "float32", "bfloat16": "float32"}


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in _EPS:
        raise ValueError(f"no tolerance for dtype {dtype!r}; known: {sorted(_EPS)}")
    return name


def tolerance(dtype: Any, reduction_size: int = 1, *, depth: int = 1) -> Dict[str, float]:
    """``{"atol": t, "rtol": t}`` for results in ``dtype`` whose computation differs only in
    summation order, through ``depth`` reductions of up to ``reduction_size`` terms each.

    Args:
        dtype: a ``torch.dtype`` or its name (``"float32"``, ``"bfloat16"``, ...).
        reduction_size: the longest sum involved (hidden size, intermediate size, context
            length, ...); at least 1.
        depth: number of chained reductions (layers) the difference propagates through.

    Returns:
        Keyword arguments for ``torch.testing.assert_close``.

    Raises:
        ValueError: an unknown dtype, or a size or depth below 1.
    """
    if reduction_size < 1 or depth < 1:
        raise ValueError(f"reduction_size and depth must be >= 1, got {reduction_size} and {depth}")
    name = _dtype_name(dtype)
    tol = depth * (ROUNDING * _EPS[name] + ORDER * math.sqrt(reduction_size) * _EPS[_ACCUMULATE[name]])
    return {"atol": tol, "rtol": tol}


def model_depth(config: Any) -> int:
    """The reductions a model output passes through: its layers plus the LM head.

    Args:
        config: a model config (or a model with a ``config`` attribute) with
            ``num_hidden_layers``.
    """
    config = getattr(config, "config", config)
    return int(config.num_hidden_layers) + 1


def model_tolerance(config: Any, dtype: Any, *, context_len: int = 0) -> Dict[str, float]:
    """:func:`tolerance` for a reference-model output (logits or hidden states).

    Args:
        config: a :class:`~cuda_graph_runner.reference.model.ModelConfig` (or a model with a
            ``config`` attribute): its hidden and intermediate sizes are the reductions,
            its layers (plus the LM head) the depth.
        dtype: the model's dtype.
        context_len: the longest attention context of the comparison (a reduction too).

    Raises:
        ValueError: an unknown dtype.
    """
    config = getattr(config, "config", config)
    size = max(int(config.hidden_size), int(config.intermediate_size), int(context_len), 1)
    return tolerance(dtype, size, depth=model_depth(config))


def assert_close(
    actual: Any, expected: Any, *, dtype: Optional[Any] = None, reduction_size: int = 1, depth: int = 1, msg: Any = None
) -> None:
    """``torch.testing.assert_close`` with :func:`tolerance` (dtype defaults to ``expected``'s).

    Raises:
        AssertionError: the tensors differ by more than the tolerance (torch's message).
    """
    import torch

    kwargs: dict[str, Any] = tolerance(dtype if dtype is not None else expected.dtype, reduction_size, depth=depth)
    torch.testing.assert_close(actual, expected, msg=msg, **kwargs)


#: Unit roundoff (half of ``torch.finfo(dtype).eps``) of the 16-bit dtypes: the largest
#: relative error of one rounding (bfloat16 2^-8, float16 2^-11).
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
#: ``(rtol, atol)`` of ``torch.testing.assert_close``'s defaults for these dtypes
#: (``torch/testing/_comparison.py``, ``_DTYPE_PRECISIONS``): rtol is a few units of
#: rounding (bfloat16 0.016 ~ 4 * 2^-8, float16 1e-3 ~ 2 * 2^-11).
TORCH_DEFAULTS = {"float16": (1e-3, 1e-5), "bfloat16": (1.6e-2, 1e-5)}
#: Units of rounding of ``max |expected|`` allowed per reduction a difference passes
#: through. Measured: one attention (bf16 SDPA against fp32 math rounded once, contexts
#: 3-4096) differs by at most 1.4 units of ``max |expected|``; the Hugging Face adapter
#: (2 layers) with ``triton`` against ``torch`` attention on an H200 by 2.1 (0.052 at
#: ``max |expected|`` 6.5); the same adapter in bf16 against float32 by 6-9.5: all below
#: ``KERNEL_ULPS * depth`` (4, and 12 for depth 3), which stays a few percent of
#: ``max |expected|`` while a wrong result (a lost KV token, a stale graph, another
#: request's row) moves the values by a sizable fraction of it.
KERNEL_ULPS = 4.0


def kernel_tolerance(expected: Any, *, dtype: Optional[Any] = None, depth: int = 1) -> Dict[str, float]:
    """``{"atol", "rtol"}`` for the outputs of two different kernels computed in float16 or bfloat16.

    ``atol = KERNEL_ULPS * depth * unit_roundoff(dtype) * max |expected|`` (at least
    torch's default atol), ``rtol`` torch's default for the dtype (:data:`TORCH_DEFAULTS`).

    Args:
        expected: the reference output, a float tensor of any shape.
        dtype: the dtype the outputs were computed in (float16 or bfloat16); defaults to
            ``expected.dtype``. Give it for a 16-bit model's logits returned in float32.
        depth: how many reductions the two computations differ through (1 for one kernel's
            output; :func:`model_depth` for a model's logits).

    Returns:
        Keyword arguments for ``torch.testing.assert_close`` (or ``torch.allclose``).

    Raises:
        ValueError: another computing dtype (float32 and float64 kernels compare with
            :func:`tolerance`), a depth below 1, or a non-finite reference.
    """
    name = str(dtype if dtype is not None else expected.dtype).replace("torch.", "")
    if name not in UNIT_ROUNDOFF:
        raise ValueError(
            f"kernel_tolerance compares outputs computed in float16 or bfloat16, got {name}; "
            "use tolerance(dtype, reduction_size) for wider dtypes"
        )
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    rtol, atol_floor = TORCH_DEFAULTS[name]
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    if not math.isfinite(scale):
        raise ValueError(f"the reference output has a non-finite value ({scale}); it cannot set a tolerance")
    return {"atol": max(KERNEL_ULPS * depth * UNIT_ROUNDOFF[name] * scale, atol_floor), "rtol": rtol}


def assert_kernels_close(
    actual: Any, expected: Any, *, dtype: Optional[Any] = None, depth: int = 1, msg: str = ""
) -> None:
    """Assert two different kernels' float16/bfloat16 outputs agree within :func:`kernel_tolerance`.

    Elementwise ``|actual - expected| <= atol + rtol * |expected|`` (as
    ``torch.testing.assert_close``); a NaN or infinity in ``actual`` where ``expected`` is
    finite fails.

    Args:
        actual: the output under test, same shape and dtype as ``expected``.
        expected: the reference output (it sets the scale).
        dtype: the dtype both were computed in; defaults to ``expected.dtype`` (see
            :func:`kernel_tolerance`).
        depth: see :func:`kernel_tolerance`.
        msg: prefixed to the failure message (what was compared).

    Raises:
        AssertionError: shapes or dtypes differ, or elements lie outside the tolerance; the
            message names how many, the tolerance and its terms, and the worst element (the
            largest ratio of difference to allowance): its index and both values.
        ValueError: see :func:`kernel_tolerance`.
    """
    import torch

    prefix = f"{msg}: " if msg else ""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(
            f"{prefix}actual {tuple(actual.shape)} {actual.dtype} against expected "
            f"{tuple(expected.shape)} {expected.dtype}"
        )
    tol = kernel_tolerance(expected, dtype=dtype, depth=depth)
    got, want = actual.detach().float(), expected.detach().float()
    diff = (got - want).abs()
    allowed = tol["atol"] + tol["rtol"] * want.abs()
    ratio = (diff / allowed).nan_to_num(nan=float("inf"))  # a NaN in actual: the worst there is
    bad = int((ratio > 1).sum())
    if bad == 0:
        return
    flat = int(ratio.flatten().argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), actual.shape))
    name = str(dtype if dtype is not None else expected.dtype).replace("torch.", "")
    raise AssertionError(
        f"{prefix}{bad} of {actual.numel()} elements differ by more than atol {tol['atol']:.4g} + "
        f"rtol {tol['rtol']:.4g} * |expected| (atol = {KERNEL_ULPS:g} * depth {depth} * "
        f"{UNIT_ROUNDOFF[name]:.4g} (unit roundoff of {name}) * max |expected| {float(want.abs().max()):.4g}); "
        f"worst at index {index}: actual {float(got.flatten()[flat]):.6g}, "
        f"expected {float(want.flatten()[flat]):.6g}, "
        f"|difference| {float(diff.flatten()[flat]):.4g} > allowed {float(allowed.flatten()[flat]):.4g}"
    )
