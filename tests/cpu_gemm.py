"""Whether this CPU's fp32 GEMMs give a row the same bits whatever the row count around it.

A padded replay multiplies ``p`` rows (the live ones, then padding) where the eager forward
multiplies the ``m`` live rows alone. The BLAS picks its kernel and blocking by the row
count, so the live rows' sums may round differently (on an AVX2-only AMD EPYC, fewer than
twelve rows alone differ from the same rows among sixteen). Tests that check a replay bit for
bit against eager ask this probe first and otherwise compare within float32 rounding."""

from __future__ import annotations

import functools
from typing import Iterable, Tuple

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


def gemm_rows_exact(model: nn.Module, rows: int, padded: Iterable[int]) -> bool:
    """True when every matrix of ``model`` gives ``rows`` rows alone the same bits as the
    same rows among ``p`` rows, for every ``p`` of ``padded`` that is ``>= rows``."""
    return all(_exact(o, i, rows, p) for o, i in _shapes(model) for p in padded if p >= rows)


def assert_replay_matches(got: torch.Tensor, expected: torch.Tensor, exact: bool, message: str) -> None:
    """Bit for bit when ``exact``, else within float32 rounding of a GEMM's sums."""
    if exact:
        assert torch.equal(got, expected), message
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=message)
