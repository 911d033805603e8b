"""Whether this CPU's fp32 GEMMs give a row the same bits whatever the row count around it.

A padded replay multiplies ``p`` rows (the live ones, then padding) where the eager forward
multiplies the ``m`` live rows alone. The BLAS picks its kernel and blocking by the row
count, so the live rows' sums may round differently (on an AVX2-only AMD EPYC, 1-3, 5-7 and
9-11 rows alone differ from the same rows among sixteen; 4 and 8 match). Only the token
axis is padded in a GEMM (the LM head runs on the live rows). Tests that check a replay bit
for bit against eager ask this probe first and otherwise compare within float32 rounding;
a replay whose token count is a captured size is bit for bit on any CPU."""

from __future__ import annotations

import functools
from typing import Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn


@functools.cache
def _exact(out_features: int, in_features: int, rows: int, padded: int) -> bool:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=g)
    x = torch.randn(padded, in_features, generator=g)
    return torch.equal(F.linear(x[:rows], weight), F.linear(x, weight)[:rows])


def _shapes(model: nn.Module) -> Tuple[Tuple[int, int], ...]:
    """The ``[out, in]`` shapes of the model's matrices (linears, and the embedding as a
    tied LM head)."""
    return tuple(sorted({tuple(p.shape) for p in model.parameters() if p.dim() == 2}))  # type: ignore[misc]


def replay_rows_exact(model: nn.Module, rows: int, sizes: Sequence[int]) -> bool:
    """True when every matrix of ``model`` gives ``rows`` token rows alone the same bits as
    the same rows among the captured size a runner pads them to (the smallest of ``sizes``
    that holds them)."""
    padded = min(s for s in sizes if s >= rows)
    return all(_exact(o, i, rows, padded) for o, i in _shapes(model))


def assert_replay_matches(got: torch.Tensor, expected: torch.Tensor, exact: bool, message: str) -> None:
    """Bit for bit when ``exact``, else within float32 rounding of a GEMM's sums."""
    if exact:
        assert torch.equal(got, expected), message
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=message)
