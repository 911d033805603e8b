"""The size axis of a runner: which sizes to capture, padding a live batch up to one,
cutting the outputs back to the live rows (each output tensor by what its leading
dimension counts, tokens or requests, learnt once per captured shape)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..backend.nested import iter_tensors, map_tensors
from ..config import PhaseConfig
from ..config.exceptions import CudaGraphRunnerError

#: What one output tensor's leading dimension counts (:func:`output_layout`): nothing to
#: cut (a 0-d tensor), the padded tokens, or the padded requests.
ROWS_NONE, ROWS_TOKENS, ROWS_REQUESTS = 0, 1, 2


class OutputRowsError(CudaGraphRunnerError, ValueError):
    """A graph output tensor whose leading dimension is neither the padded token count nor
    the padded batch size: the runner could not cut it back to the live batch.

    Attributes:
        path: where it sits in the output structure (``"decode graph output['lse']"``).
        shape: its shape at capture.
    """

    def __init__(self, path: str, shape: tuple, tokens: int, requests: "int | None") -> None:
        self.path = path
        self.shape = shape
        per_request = "" if requests is None or requests == tokens else f" or the padded batch size {requests}"
        super().__init__(
            f"{path} has shape {shape}: its leading dimension {shape[0]} is neither the padded token count "
            f"{tokens}{per_request}, so a replay could not cut it back to the live batch's rows. Return tensors "
            "with one row per token" + (" or one per request" if per_request else "") + " first (0-d tensors pass "
            "as they are); anything across the batch belongs outside the graph"
        )


def output_layout(output: Any, *, tokens: int, requests: "int | None" = None, where: str = "output") -> tuple:
    """What each tensor of a graph output counts along its leading dimension, in
    :func:`~cuda_graph_runner.backend.nested.iter_tensors` order: :data:`ROWS_TOKENS` when it is
    ``tokens`` (the padded token count; checked first, so with one token per request a
    tensor counts tokens), :data:`ROWS_REQUESTS` when it is ``requests`` (the padded
    batch size; None where the graph has no request axis, prefill), :data:`ROWS_NONE`
    for a 0-d tensor.

    Raises:
        OutputRowsError: a tensor with another leading dimension (names its path).
    """
    layout = []
    for path, t in iter_tensors(output, where=where):
        if t.dim() == 0:
            layout.append(ROWS_NONE)
        elif t.shape[0] == tokens:
            layout.append(ROWS_TOKENS)
        elif requests is not None and t.shape[0] == requests:
            layout.append(ROWS_REQUESTS)
        else:
            raise OutputRowsError(path, tuple(t.shape), tokens, requests)
    return tuple(layout)


def slice_output(output: Any, layout: tuple, tokens: int, requests: int) -> Any:
    """``output`` cut back to a live batch of ``tokens`` tokens and ``requests`` requests:
    each tensor to the rows its :func:`output_layout` entry counts (views, no copy), through
    the structures :mod:`cuda_graph_runner.backend.nested` walks; constants pass through."""
    if isinstance(output, torch.Tensor):  # the common case (logits), without the walker
        kind = layout[0]
        return output if kind == ROWS_NONE else output[: tokens if kind == ROWS_TOKENS else requests]
    kinds = iter(layout)

    def cut(t: torch.Tensor) -> torch.Tensor:
        kind = next(kinds, ROWS_TOKENS)
        return t if kind == ROWS_NONE else t[: tokens if kind == ROWS_TOKENS else requests]

    return map_tensors(cut, output)


def get_batch_sizes_to_capture(
    phase_config: PhaseConfig,
    default_max: int,
    default_sizes: Callable[[int], list[int]],
    *,
    add_max: bool = True,
) -> list[int]:
    """The sizes to capture, ascending (sglang's ``generate_*_cuda_graph_batch_sizes``).

    Explicit ``phase_config.bs`` is captured as it is, ``max_bs`` ignored (sglang makes
    max_bs max(bs)). Otherwise ``default_sizes(max)``, cut at ``max_bs``; with
    ``add_max`` (decode) ``max_bs`` itself is captured too, even off the stride (12, 20,
    50), as sglang's decode does; prefill (``add_max=False``) stops at the last bucket
    (``max_bs`` 5000: 4608), as sglang's prefill does.

    Raises:
        ValueError: no size is left (prefill ``max_bs`` below the smallest bucket).
    """
    max_bs = phase_config.max_bs
    if phase_config.bs:
        sizes = sorted(set(int(s) for s in phase_config.bs))
    else:
        sizes = default_sizes(max_bs if max_bs is not None else default_max)
        if max_bs is not None:
            sizes = [s for s in sizes if s <= max_bs]
            if add_max and max_bs not in sizes:
                sizes.append(max_bs)
    sizes = sorted(set(sizes))
    if not sizes or sizes[0] <= 0:
        raise ValueError(f"no positive size to capture (bs={phase_config.bs}, max_bs={max_bs})")
    return sizes


def slice_rows(output: Any, rows: int) -> Any:
    """``t[:rows]`` for every tensor of ``output`` with at least one dimension (views, no
    copy), through tuples, NamedTuples, lists, dicts and dataclasses, rebuilt with the
    same types (:mod:`cuda_graph_runner.backend.nested`); constants and 0-d tensors pass through."""
    if isinstance(output, torch.Tensor):  # the common case (logits), without the walker
        return output[:rows] if output.dim() > 0 else output
    return map_tensors(lambda t: t[:rows] if t.dim() > 0 else t, output)


def pad_list(values: Sequence[int] | None, rows: int, fill: int) -> list[int] | None:
    """A host list padded with ``fill`` up to ``rows`` entries (None stays None)."""
    if values is None:
        return None
    values = list(values)
    return values + [fill] * (rows - len(values))
