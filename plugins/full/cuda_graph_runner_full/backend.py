"""``FullCudaGraphBackend``: the whole forward of one shape recorded as one device graph."""

from __future__ import annotations

from typing import Any

from cuda_graph_runner.backend import BaseCudaGraphBackend, ForwardFn, ShapeKey, WarmupHook
from cuda_graph_runner.forward_batch import ForwardBatch


class FullCudaGraphBackend(BaseCudaGraphBackend):
    """One ``CUDAGraph`` per ``ShapeKey``, all captured into the runner's shared pool.

    Capture (per shape, ``BaseCudaGraphBackend.record_graph``): the warm-up runs of
    ``forward_fn`` on the capture stream that the ``warmup`` policy asks for
    (``BaseCudaGraphBackend.warmup_runs``), ``post_warmup_hook()``, a synchronize, then
    one recorded run inside ``device_module.graph(g, pool=pool, stream=stream)`` (caches
    emptied only before the session's first graph, ``BaseCudaGraphBackend.graph_capture``),
    all on ``self.device`` (explicit synchronize, capture stream made on it; the runner
    holds its device guard). Replay runs on the caller's current stream of that device.
    The tensors that recorded run returned are kept as the shape's output: every replay
    rewrites them in place, so a caller must consume (or copy) an output before the next
    replay of any graph in the pool (sglang ``FullCudaGraphBackend``; PyTorch "CUDA
    Graphs" notes). Sessions, ``can_run``, ``cleanup`` and ``captured_keys`` are the base
    class's.

    Args (beyond ``BaseCudaGraphBackend``'s):
        weak_ref_outputs: keep non-owning aliases of each shape's outputs (CUDA only),
            so the shapes share pool memory (:mod:`cuda_graph_runner.weak_ref`). An output
            is valid until the next replay either way.

    Everything the forward reads must live at the addresses it had at capture: the
    runner's static buffers, the model's weights and KV cache. Data-dependent control
    flow and host syncs inside the forward are frozen or forbidden, as with any graph.
    """

    def __init__(self, *args: Any, weak_ref_outputs: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.weak_ref_outputs = weak_ref_outputs

    def capture_one(self, key: ShapeKey, forward_fn: ForwardFn, *, post_warmup_hook: WarmupHook = None) -> None:
        """Warm up, then record ``forward_fn`` for ``key`` (``record_graph``)."""
        self.record_graph(
            key, forward_fn, self.device_module.CUDAGraph, post_warmup_hook, weak_ref_outputs=self.weak_ref_outputs
        )

    def replay(self, key: ShapeKey, static_batch: ForwardBatch) -> Any:
        """Replay ``key``'s graph; returns the capture's output tensors.

        Raises:
            KeyError: no graph captured for ``key``.
        """
        return self.replay_graph(key)
