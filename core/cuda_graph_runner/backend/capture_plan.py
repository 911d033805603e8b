"""The capture plan: what a runner hands its backend before capture (plugin API 1.1).

A backend needs more than ``capture_one``'s ``forward_fn`` when it works on the model
as a whole (tc_piecewise compiles the forward once for every size before any capture,
and runs that compiled forward at replay). The runner gives it a :class:`CapturePlan`,
so any backend, ours or a vendor's, gets the same information through the contract,
never by reading runner attributes:

* ``plan.keys``: every ``ShapeKey`` the runner captures, largest first; since 1.3 a key
  may be two-dimensional (``key.requests`` request slots x ``key.size`` tokens: the
  mixed runner's keys; ``plan.shapes`` lists ``(requests, tokens)``), and its static
  batch then has ``key.requests`` rows on every request-axis field;
* ``plan.static_batch(key)``: the static dummy batch of ``key`` that capture runs on
  (views of the runner's static buffers, filled with pad values, the model's
  ``init_forward_metadata_capture`` already called);
* ``plan.forward(batch)``: the forward one graph records and a replay runs (decode: the
  model body and the LM head, float32 logits ``[tokens, vocab]``; prefill: the body,
  hidden states ``[tokens, hidden]``). It reads the batch it is given, so at replay it
  is called with the ``static_batch`` ``replay`` receives, never with a capture batch;
* ``plan.run(key)``: ``plan.forward(plan.static_batch(key))`` inside the forward context
  (a compile pass over every size);
* ``plan.wrap_model_forward(forward, active=...)``: the one sanctioned way to replace
  the model's forward (:mod:`cuda_graph_runner.backend.model_forward`).

The runner calls ``backend.set_capture_plan(plan)`` and then ``backend.prepare(plan)``
once per capture session; the plan stays on ``backend.capture_plan`` for replays.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

from .base import ShapeKey
from .context import forward_context
from .forward_batch import ForwardBatch, as_static_batch


class CapturePlan:
    """What a backend may know of a runner's capture: keys, capture batches, the forward.

    Args:
        phase: ``"decode"`` or ``"prefill"``.
        model: the model the runner drives (read-only for a backend: to replace its
            forward, use :meth:`wrap_model_forward`).
        keys: every key of the runner's capture sizes (sorted largest first here).
        static_batch: ``key -> ForwardBatch``, the capture batch of ``key``.
        forward: ``batch -> output``, the forward one graph records (no forward context
            entered: the caller enters it, the runner does at capture and replay).
        host_value_guard: the host-value guard scope the runner captures under
            (:mod:`cuda_graph_runner.backend.host_guard`; ``"off"`` when the config turned it
            off; default ``"forward"``, the base backend's): a backend that traces or runs
            bodies ahead of the capture arms it there.

    Raises:
        TypeError: ``keys`` holds something other than ``ShapeKey``.
    """

    def __init__(
        self,
        *,
        phase: str,
        model: Any,
        keys: Sequence[ShapeKey],
        static_batch: Callable[[ShapeKey], ForwardBatch],
        forward: Callable[[ForwardBatch], Any],
        host_value_guard: str = "forward",
    ) -> None:
        bad = [k for k in keys if not isinstance(k, ShapeKey)]
        if bad:
            raise TypeError(f"CapturePlan keys must be ShapeKey, got {bad!r}")
        self.phase = phase
        self.model = model
        self.keys: Tuple[ShapeKey, ...] = tuple(sorted(set(keys), reverse=True))
        self._static_batch = static_batch
        self._forward = forward
        self.host_value_guard = host_value_guard

    @property
    def sizes(self) -> List[int]:
        """The sizes of :attr:`keys`, largest first (batch sizes or token counts)."""
        return [k.size for k in self.keys]

    @property
    def shapes(self) -> List[Tuple[Optional[int], int]]:
        """``(requests, tokens)`` of each of :attr:`keys` (plugin API 1.3), in the same
        order: ``requests`` is ``ShapeKey.requests`` (None for a one-dimensional key,
        whose ``tokens`` is its size)."""
        return [(k.requests, k.size) for k in self.keys]

    def static_batch(self, key: ShapeKey) -> ForwardBatch:
        """The static dummy batch ``key`` is captured on (the same one ``capture_one``'s
        ``forward_fn`` reads): token-axis int64 tensors ``[key.size * width]`` viewing the
        runner's buffers, which a replay later fills with the live batch.

        Raises:
            KeyError: ``key`` is not among :attr:`keys` (lists them).
        """
        if key not in self.keys:
            raise KeyError(f"{key} is not in this capture plan; planned: {list(self.keys)}")
        return self._static_batch(key)

    def forward(self, batch: ForwardBatch) -> Any:
        """Run the forward one graph records on ``batch`` (enter ``forward_context(batch)``
        first when the model's marked ops read it; the runner does at capture and replay).
        A backend that runs the forward itself at replay calls this with the
        ``static_batch`` its ``replay`` got."""
        return self._forward(batch)

    def run(self, key: ShapeKey) -> Any:
        """``forward(static_batch(key))`` inside ``forward_context``: one eager (or, for a
        backend that wrapped the forward, compiled) pass at ``key``'s size."""
        batch = self.static_batch(key)
        with forward_context(batch):
            return self.forward(batch)

    def wrap_model_forward(self, forward: Callable[..., Any], *, active: Callable[[], bool]) -> Any:
        """Let ``forward`` stand in for the model's forward while ``active()`` is true;
        returns the handle (``.original``, ``.remove()``) of
        :func:`cuda_graph_runner.backend.model_forward.wrap_model_forward`."""
        from .model_forward import wrap_model_forward

        return wrap_model_forward(self.model, forward, active=active)

    def __repr__(self) -> str:
        return f"CapturePlan(phase={self.phase!r}, keys={list(self.keys)})"


# -- the runner's side: the plan a runner builds before capture --------------------------------------


def capture_static_batch(runner: Any, size: int, variant: str = "") -> ForwardBatch:
    """The static dummy batch of ``size`` (in graph ``variant``) that capture runs on: the
    runner's ``capture_prepare`` as a static batch, with the model's
    ``init_forward_metadata_capture`` called on it (what ``capture_one_shape`` and the
    plan's ``static_batch`` both need)."""
    prepare = getattr(runner, "capture_prepare_variant", None)
    raw = prepare(size, variant) if prepare is not None else runner.capture_prepare(size)
    batch = as_static_batch(raw, **({"graph_variant": variant} if variant else {}))
    init = getattr(runner.model, "init_forward_metadata_capture", None)
    if init is not None:
        init(batch)
    return batch


def build_capture_plan(runner: Any) -> CapturePlan:
    """The plan of ``runner``: every capture size's key, its capture batch, the runner's
    graph forward."""

    # Every size in every variant the runner captures (runner/variants.py), largest first.
    variant_of = {
        runner.make_variant_key(size, variant): variant
        for size in runner.capture_sizes
        for variant in runner.size_variants(size)
    }

    def static_batch(key: ShapeKey) -> ForwardBatch:
        return capture_static_batch(runner, key.size, variant_of.get(key, ""))

    return CapturePlan(
        phase=runner.phase,
        model=runner.model,
        keys=list(variant_of),
        static_batch=static_batch,
        forward=runner.graph_forward,
        host_value_guard=runner.host_value_guard_scope(),
    )
