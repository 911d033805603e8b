"""The size axis of a runner: which sizes to capture, padding a live batch up to one,
slicing the outputs back to the live rows."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..config import PhaseConfig
from ..nested import map_tensors


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
    same types (:mod:`cuda_graph_runner.nested`); constants and 0-d tensors pass through."""
    if isinstance(output, torch.Tensor):  # the common case (logits), without the walker
        return output[:rows] if output.dim() > 0 else output
    return map_tensors(lambda t: t[:rows] if t.dim() > 0 else t, output)


def pad_list(values: Sequence[int] | None, rows: int, fill: int) -> list[int] | None:
    """A host list padded with ``fill`` up to ``rows`` entries (None stays None)."""
    if values is None:
        return None
    values = list(values)
    return values + [fill] * (rows - len(values))
