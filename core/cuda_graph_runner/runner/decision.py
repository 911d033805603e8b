"""``ReplayDecision``: what a runner found for one live batch, carried from ``can_run`` to
``replay`` so the padded size and the graph's key are computed once per batch."""

from __future__ import annotations

import dataclasses

from ..backend import ShapeKey


@dataclasses.dataclass(frozen=True)
class ReplayDecision:
    """A live batch replays the graph of ``key``, padded from ``size`` to ``padded``.

    Made by :meth:`BaseCudaGraphRunner.decide` (None there means "run eagerly"), handed to
    :meth:`~BaseCudaGraphRunner.replay` and ``replay_prepare`` by ``forward``; valid for
    that one batch only.

    Attributes:
        size: the batch's size along the runner's axis (requests for decode, tokens for
            prefill), >= 1.
        padded: the smallest captured size >= ``size``.
        key: the ``ShapeKey`` of the captured graph of ``padded``.
    """

    size: int
    padded: int
    key: ShapeKey
