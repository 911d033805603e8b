"""Capture on the caller's schedule: the ``eager_first`` capture policy.

With the phase config's ``capture: eager_first`` (default ``blocking``: every size
captured inside ``capture()``), ``runner.capture()`` only queues the sizes and returns
at once; ``forward`` serves every batch whose size holds no graph yet eagerly (counted in
``run_stats()`` under ``"not captured yet"``), and ``runner.capture_step(budget_ms)``
captures (and, for compiled backends, compiles) as many queued sizes as fit in the
budget, whenever the caller has time for it (between engine steps, while idle):

* the order: the capture sizes live traffic used first, most observed first (each
  eager batch counted under the capture size that would serve it), then the rest
  largest first, as a blocking capture orders them;
* a size switches to replay when its graph is ready: it is published to the runner's
  graph list only after every variant of it was captured; a capture that raises midway
  is rolled back (the backend drops what it began), the size stays queued and eager
  serves it; the error is raised to the caller of ``capture_step``, and the next call
  tries again;
* a call captures at least one size (a size is never split across calls), then starts
  the next only while the time left fits the last size's capture time, so a call may
  overrun ``budget_ms`` by up to one size; the first call also pays the backend's
  ``prepare``, once per capture (tc_piecewise's and compiled full's compile pass over
  every size, in one piece: the backend contract has no per-size prepare);
* ``cleanup()`` between calls drops the graphs and the queue (``capture()`` queues
  again); ``sleep()`` remembers captured and queued sizes alike and ``wake()`` queues
  them again, so nothing is left half-done;
* tensor or data parallel: every call runs on every rank. The ranks merge their
  observed counts (one host gather per call), check that they would capture the same
  sizes in the same order (the capture's size agreement), and agree before each further
  size whether every rank still has time (one host all-reduce), so every rank captures
  the same sizes in the same call and a size switches to replay at the same step on all
  of them; a failure on one rank rolls the size back on all (the capture's per-size
  agreement). The gather runs on every call, even with nothing left: stop calling once
  a step says ``done``. These waits are capture-time agreements, bounded by the group's
  ``capture_timeout_s`` (:mod:`cuda_graph_runner.runner.distributed`).

The capture's warm-up and recording forwards run on the runner's dummy batch: every
padded request reads request row 0 and writes KV slot 0, the cache's reserved dummies
(:class:`cuda_graph_runner.reference.kv_cache.PagedKVCache` reserves both, as sglang's
pools do). An engine capturing while it serves must keep row 0 and slot 0 out of its
allocators; then no capture step touches a live request's KV.

Pool memory: sizes captured in traffic order rather than largest first may leave the
shared pool larger than a blocking capture's (a larger graph cannot reuse the blocks of
smaller ones); ``benchmarks/eager_first.py`` reports both.

Threads are not used: ``forward_replaced`` swaps an instance attribute and Dynamo's
``set_stance`` is process-wide, so a capture running beside a forward would race it.

Idea: vLLM RFC #20098 ("lazy" CUDA graph capture) and sglang's startup reports
(#6830, #3902); neither serves while it captures.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import numbers
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set

from .capture_report import CaptureReport

if TYPE_CHECKING:
    from .base import BaseCudaGraphRunner

logger = logging.getLogger(__name__)

#: The ``capture`` key's values (:data:`cuda_graph_runner.config.CAPTURE_POLICIES`).
BLOCKING = "blocking"
EAGER_FIRST = "eager_first"

#: The capture step's gather of every rank's observed counts, in a timeout's message.
_STEP_COUNTS = "the capture step's gather of the sizes live traffic ran"


@dataclasses.dataclass
class CaptureStep:
    """What one ``runner.capture_step(budget_ms)`` call did.

    Attributes:
        sizes: sizes captured by this call (every variant of each), in capture order.
        ms: milliseconds each of ``sizes`` took (warm-ups, recording and its compile).
        seconds: wall time of the call (the backend's ``prepare`` included).
        ready: capture sizes that replay now.
        remaining: queued sizes not captured yet.
        total: the runner's capture sizes.
    """

    sizes: List[int]
    ms: List[float]
    seconds: float
    ready: int
    remaining: int
    total: int

    @property
    def done(self) -> bool:
        """Whether no queued size is left."""
        return self.remaining == 0


class LazyCapture:
    """The ``eager_first`` state of one runner: the queued sizes, the observed traffic
    per capture size, and the capture steps so far (``runner.lazy_capture``)."""

    def __init__(self, runner: "BaseCudaGraphRunner") -> None:
        self.runner = runner
        self._queued: Set[int] = set()
        #: capture size -> eager batches it would have served (counted while queued).
        self.observed: Dict[int, int] = collections.Counter()
        #: Each step that captured something, in order (since the last ``cleanup()``).
        self.steps: List[CaptureStep] = []
        self.seconds: float = 0.0

    # -- queue ---------------------------------------------------------------------------
    def queue(self, sizes: Sequence[int]) -> None:
        """Queue ``sizes`` (capture sizes without a graph) for later steps."""
        self._queued.update(int(s) for s in sizes)
        logger.info(
            "%s capture eager_first: %d sizes queued, %d of %d ready; batches run eagerly until their size is captured",
            self.runner.phase,
            len(self.pending()),
            self.ready(),
            len(self.runner.capture_sizes),
        )

    def pending(self) -> Set[int]:
        """Queued sizes that hold no graph yet (the runner's graph list is the truth)."""
        return self._queued - {k.size for k in self.runner.captured_keys}

    def ready(self) -> int:
        """Capture sizes that hold a graph (every variant: a size is listed once whole)."""
        return len({k.size for k in self.runner.captured_keys})

    def clear(self) -> None:
        """Forget the queue, the observations and the steps (``cleanup()``)."""
        self._queued.clear()
        self.observed.clear()
        self.steps.clear()
        self.seconds = 0.0

    def is_queued(self, padded: int) -> bool:
        """Whether capture size ``padded`` is queued and holds no graph yet: a batch that
        :meth:`BaseCudaGraphRunner.decide` pads to it (within the runner's limits) runs
        eagerly, reason ``"not captured yet"``. Asked on the eager path only."""
        return padded in self._queued and not any(k.size == padded for k in self.runner.captured_keys)

    def observe(self, padded: int) -> None:
        """One eager batch that queued capture size ``padded`` will serve (``forward``
        counts it; the capture order reads the counts): one dict update per eager step."""
        self.observed[padded] += 1

    def order(self, observed: Optional[Dict[int, int]] = None) -> List[int]:
        """The pending sizes in capture order: observed ones, most observed first (ties:
        larger first), then the others largest first."""
        counts = self.observed if observed is None else observed
        pending = self.pending()
        seen = sorted((s for s in pending if counts.get(s, 0) > 0), key=lambda s: (-counts[s], -s))
        rest = sorted((s for s in pending if counts.get(s, 0) <= 0), reverse=True)
        return seen + rest

    def progress(self) -> Dict[str, Any]:
        """``{"policy", "ready", "total", "pending", "steps", "seconds", "observed"}``:
        how far the capture is (plain JSON; ``run_stats()["capture"]``)."""
        return {
            "policy": EAGER_FIRST,
            "ready": self.ready(),
            "total": len(self.runner.capture_sizes),
            "pending": len(self.pending()),
            "steps": len(self.steps),
            "seconds": self.seconds,
            "observed": {str(s): n for s, n in sorted(self.observed.items())},
        }

    # -- one step --------------------------------------------------------------------------
    def step(self, budget_ms: Optional[float]) -> CaptureStep:
        """See :meth:`BaseCudaGraphRunner.capture_step`."""
        import torch

        runner = self.runner
        budget_s = check_budget(budget_ms)
        start = time.perf_counter()
        group = runner.rank_group
        parallel = group is not None and group.is_parallel
        counts: Dict[int, int] = self.observed
        if parallel:  # data parallel ranks see different traffic: order by the sum
            assert group is not None
            counts = collections.Counter()
            for theirs in group.gather_objects(dict(self.observed), what=_STEP_COUNTS, capture=True):
                counts.update(theirs)
        todo = self.order(counts)
        # Every rank the same sizes in the same order, or an error on all (a rank with
        # nothing queued still meets the others' gather).
        runner._agree_sizes_to_capture(todo)
        report = CaptureReport(runner.phase, runner.backend.name, [], runner._captured_sizes(), 0.0)

        def size_seconds(size: int) -> float:
            # Keys of a size captured by this call were all recorded by it.
            return sum(s for k, s in runner.key_capture_seconds.items() if k.size == size)

        if todo and runner.sleep_state is None:
            from .arguments import claim_backend

            claim_backend(runner.backend, runner)  # another runner may have taken it since

            def keep_going(size: int) -> bool:
                last = size_seconds(report.sizes[-1])
                fits = budget_s is None or time.perf_counter() - start + last <= budget_s
                if parallel and group is not None:
                    return group.all_true(fits, what="the capture step's agreement on the budget", capture=True)
                return fits

            try:
                with torch.no_grad():  # a capture-time grad_fn would ride on every replayed output
                    runner._capture_sizes(todo, report, keep_going=keep_going)
            finally:
                self.seconds += time.perf_counter() - start
                runner.capture_seconds = self.seconds
        sizes = list(report.sizes)
        ms = [1e3 * size_seconds(s) for s in sizes] if sizes else []
        step = CaptureStep(
            sizes=sizes,
            ms=ms,
            seconds=time.perf_counter() - start,
            ready=self.ready(),
            remaining=len(self.pending()),
            total=len(runner.capture_sizes),
        )
        if sizes:  # bounded: an engine may keep calling after the last size
            self.steps.append(step)
            logger.info(
                "%s capture step: %d sizes (%s) in %.1f ms, %d of %d ready, %d to go",
                runner.phase,
                len(sizes),
                ", ".join(str(s) for s in sizes),
                1e3 * step.seconds,
                step.ready,
                step.total,
                step.remaining,
            )
        return step


def check_budget(budget_ms: Any) -> Optional[float]:
    """``budget_ms`` in seconds (None: no limit).

    Raises:
        TypeError: not a number or None (a bool is refused).
        ValueError: not positive, or NaN.
    """
    if budget_ms is None:
        return None
    if isinstance(budget_ms, bool) or not isinstance(budget_ms, numbers.Real):
        raise TypeError(
            f"budget_ms={budget_ms!r}: expected milliseconds as a number > 0, or None to capture every queued size"
        )
    value = float(budget_ms)
    if math.isnan(value) or value <= 0:
        raise ValueError(f"budget_ms={budget_ms!r}: expected milliseconds > 0, or None to capture every queued size")
    return None if math.isinf(value) else value / 1e3


def empty_step(runner: "BaseCudaGraphRunner") -> CaptureStep:
    """The step of a runner with nothing to capture step by step (policy ``blocking``,
    backend ``disabled``)."""
    ready = len({k.size for k in runner.captured_keys})
    return CaptureStep(sizes=[], ms=[], seconds=0.0, ready=ready, remaining=0, total=len(runner.capture_sizes))
