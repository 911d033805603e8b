"""How one live batch runs, decided once per batch by :meth:`BaseCudaGraphRunner.decide`:
a :class:`ReplayDecision` (the graph it replays) or an :class:`EagerDecision` (why it runs
eagerly). ``can_run`` and ``forward`` read it; ``forward`` records an eager decision's reason
in the run statistics (:mod:`.stats`) as it is, without deciding again."""

from __future__ import annotations

import dataclasses
from typing import Union

from ..backend.base import ShapeKey

__all__ = ["Decision", "EagerDecision", "ReplayDecision"]


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


@dataclasses.dataclass(frozen=True)
class EagerDecision:
    """A live batch runs eagerly, for ``reason``.

    Attributes:
        reason: why no graph takes the batch, one of :data:`.stats.REASONS` (``"too large"``,
            ``"not captured"``, ...): the key ``run_stats()["eager_fallbacks"]`` counts it under.
        queued: with reason ``"not captured yet"`` (``capture: eager_first``), the queued
            capture size whose graph will take the batch (``forward`` counts the batch as
            that size's traffic, :mod:`.lazy_capture`); 0 otherwise.
    """

    reason: str
    queued: int = 0


#: What :meth:`BaseCudaGraphRunner.decide` returns.
Decision = Union[ReplayDecision, EagerDecision]
