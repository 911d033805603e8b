"""``ReplayDecision``: how one live batch replays (or None: it runs eagerly), decided once
per batch by :meth:`BaseCudaGraphRunner.decide` (``can_run`` and ``forward`` read it)."""

from __future__ import annotations

import dataclasses

from ..backend.base import ShapeKey


@dataclasses.dataclass(frozen=True)
class ReplayDecision:
    """A live batch replays the graph of ``key``, padded from ``size`` to ``padded``.

    The padded size and key come from :meth:`BaseCudaGraphRunner.replay_target`, computed
    on the first batch of each live size and shared with ``replay_prepare``'s plans, so a
    batch never computes them twice. Valid for that one batch.

    Attributes:
        size: the batch's size along the runner's axis (requests for decode, tokens for
            prefill), >= 1.
        padded: the smallest captured size >= ``size``.
        key: the ``ShapeKey`` of the captured graph of ``padded`` (in ``variant``).
        variant: the graph variant the batch needs (:mod:`.variants`; ``""``: none).
    """

    size: int
    padded: int
    key: ShapeKey
    variant: str = ""
