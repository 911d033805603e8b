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
    return tolerance(dtype, size, depth=int(config.num_hidden_layers) + 1)


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
