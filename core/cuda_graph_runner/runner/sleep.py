"""Sleep and wake: give a runner's graph memory back to the device and make it usable again.

``runner.sleep()`` drops every graph (``cleanup()``: the backend's graphs, the model's
per-size attention state of the runner's forward mode), releases the shared graph pool
once no graph uses it and empties the caching allocator, so the pool's memory shows in
``torch.cuda.mem_get_info()``. The runner remembers the sizes it held. While asleep,
``forward`` runs each batch eagerly (counted in ``run_stats()`` under ``"asleep"``) or
raises :class:`RunnerAsleepError`, by the phase config's ``forward_asleep`` key.

``runner.wake()`` captures those sizes again, every variant, largest first. What a
backend keeps across ``cleanup()`` is reused (tc_piecewise's compiled pieces and Dynamo's
cache), so a wake costs the warm-ups and the recording, not a compile (the ratio to the
first capture: ``docs/graph-memory.md``). The new graphs read the weights the model has at
wake, so weights loaded while asleep need not be written in place (they must be, for
graphs of other runners that stay awake).

Nothing is left half done: a sleep that fails midway leaves the runner asleep with its
sizes remembered (a later ``wake()`` recaptures them); a wake that fails midway drops
what it captured and leaves the runner asleep as it was, the error raised.

Tensor parallel: every rank sleeps and wakes. A wake goes through the capture's size
agreement, also on a rank that is awake (it captures nothing), so a wake where only some
ranks slept raises on every rank instead of leaving one waiting.

The pool is shared by every runner on a device (:mod:`cuda_graph_runner.backend.pool`): its
memory goes back only when every runner using it sleeps (or was cleaned up), and
segments that an output a caller still holds points into stay until it is dropped.

Idea: vLLM's sleep mode (``LLM.sleep(level)`` / ``wake_up``: graph memory offloaded or
discarded through a cuMem allocator, ``cudagraph_pool.py``) and sglang's memory saver
(``release_memory_occupation`` / ``resume_memory_occupation``, graphs under the
``cuda_graph`` tag). Here the graphs are recaptured rather than restored: torch's
caching allocator cannot unmap and remap a private pool at the same addresses.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, List, Optional

from ..backend.errors import CudaGraphRunnerError
from .capture_report import CaptureReport
from .weights import WeightsFingerprint

if TYPE_CHECKING:
    from .base import BaseCudaGraphRunner

logger = logging.getLogger(__name__)


class RunnerAsleepError(CudaGraphRunnerError, RuntimeError):
    """``forward`` of a sleeping runner whose ``forward_asleep`` is ``raise``."""


class SleepState:
    """What a sleeping runner remembers: the sizes to recapture and the weights' storage
    when it fell asleep (to tell, at wake, which parameters were re-assigned)."""

    __slots__ = ("sizes", "weights", "freed_bytes")

    def __init__(self, sizes: List[int], weights: Optional[WeightsFingerprint], freed_bytes: Optional[int]) -> None:
        self.sizes = sizes
        self.weights = weights
        self.freed_bytes = freed_bytes


def asleep_error(runner: "BaseCudaGraphRunner") -> RunnerAsleepError:
    """The error ``forward`` raises on a sleeping ``runner`` whose ``forward_asleep`` is
    ``raise`` (names the phase, the backend and both ways out)."""
    return RunnerAsleepError(
        f"the {runner.phase} runner ({runner.backend.name}) is asleep (runner.sleep() gave its graphs back): "
        "call runner.wake() before forward, or set the phase config's forward_asleep to 'eager' to run "
        "batches eagerly while asleep"
    )


def _empty_cache(runner: "BaseCudaGraphRunner") -> None:
    device, module = runner._graph_device()
    empty_cache = getattr(module, "empty_cache", None) if module is not None else None
    if empty_cache is not None:
        empty_cache()


def sleep(runner: "BaseCudaGraphRunner") -> Optional[int]:
    """See :meth:`BaseCudaGraphRunner.sleep`."""
    if runner.sleep_state is not None or runner.is_disabled:
        return 0
    sizes = runner._captured_sizes()
    weights = runner._weights
    try:
        before = runner.backend.graph_memory_bytes()
    except Exception:  # a measurement must not stop the sleep
        before = None
    try:
        runner.cleanup()
    finally:
        # Whatever cleanup() got through, the runner replays nothing now and wake() recaptures
        # every size it held: asleep either way.
        runner.captured_keys.clear()
        runner.sleep_state = SleepState(sizes, weights, None)
    _empty_cache(runner)
    try:
        after = runner.backend.graph_memory_bytes()
    except Exception:
        after = None
    freed = before - (after or 0) if before is not None else None
    runner.sleep_state.freed_bytes = freed
    if after:
        logger.warning(
            "%s runner asleep but %d bytes stay in its graph pool: other graphs use the pool (sleep every "
            "runner sharing it: decode and prefill) or outputs of earlier replays are still referenced",
            runner.phase,
            after,
        )
    logger.info(
        "%s runner asleep: %d sizes dropped, %s bytes of graph pool given back",
        runner.phase,
        len(sizes),
        "unknown" if freed is None else freed,
    )
    return freed


def wake(runner: "BaseCudaGraphRunner") -> CaptureReport:
    """See :meth:`BaseCudaGraphRunner.wake`."""
    state = runner.sleep_state
    if state is None:
        # Awake: nothing to capture, but a TP rank still meets the others' size agreement,
        # so ranks of which only some slept raise at once instead of waiting.
        return runner.capture(sizes=[])
    runner.sleep_state = None
    try:
        report = runner.capture(sizes=state.sizes)
    except BaseException:
        # Back to asleep as it was: no half-woken runner replaying some sizes.
        try:
            runner.cleanup()
        except Exception as exc:  # the capture error being raised matters more
            logger.warning("could not drop the graphs of a failed wake: %s", exc)
        runner.captured_keys.clear()
        runner.sleep_state = state
        _empty_cache(runner)
        raise
    if state.weights is not None and runner._weights is not None and not state.weights.same_as(runner._weights):
        changed, missing, added = state.weights.diff(runner._weights)
        logger.info(
            "%s runner woke with re-assigned weights (%d moved, %d gone, %d new): the new graphs read them",
            runner.phase,
            len(changed),
            len(missing),
            len(added),
        )
    return report
