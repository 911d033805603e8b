"""The runner's side of the capture plan: build the
:class:`~cuda_graph_runner.capture_plan.CapturePlan` a backend gets before capture."""

from __future__ import annotations

from typing import Any

from ..backend import ShapeKey
from ..capture_plan import CapturePlan
from ..forward_batch import ForwardBatch, as_static_batch


def capture_static_batch(runner: Any, size: int, variant: str = "") -> ForwardBatch:
    """The static dummy batch of ``size`` (in graph ``variant``) that capture runs on: the
    runner's ``capture_prepare`` as a static batch, with the model's
    ``init_forward_metadata_capture`` called on it (what ``capture_one_shape`` and the
    plan's ``static_batch`` both need)."""
    batch = as_static_batch(runner.capture_prepare(size), **({"graph_variant": variant} if variant else {}))
    init = getattr(runner.model, "init_forward_metadata_capture", None)
    if init is not None:
        init(batch)
    return batch


def build_capture_plan(runner: Any) -> CapturePlan:
    """The plan of ``runner``: every capture size's key, its capture batch, the runner's
    graph forward; the runner itself answers the 1.0 attributes (deprecated)."""

    # Every size in every variant the runner captures (runner/variants.py), largest first.
    variant_of = {
        runner.make_variant_key(size, variant): variant
        for size in runner.capture_sizes
        for variant in runner.capture_variants()
    }

    def static_batch(key: ShapeKey) -> ForwardBatch:
        return capture_static_batch(runner, key.size, variant_of.get(key, ""))

    return CapturePlan(
        phase=runner.phase,
        model=runner.model,
        keys=list(variant_of),
        static_batch=static_batch,
        forward=runner.graph_forward,
        legacy=runner,
        host_value_guard=runner.host_value_guard_scope(),
    )
