"""``FullCudaGraphBackend``: the whole forward of one shape recorded as one device graph."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Dict, Iterator, Optional

from cuda_graph_runner.backend import BaseCudaGraphBackend, ForwardFn, ShapeKey
from cuda_graph_runner.forward_batch import ForwardBatch
from cuda_graph_runner.nested import iter_tensors
from cuda_graph_runner.weak_ref import weak_ref_tensors

from .compiled import CompiledForward


class FullCudaGraphBackend(BaseCudaGraphBackend):
    """One ``CUDAGraph`` per ``ShapeKey``, all captured into the runner's shared pool.

    Capture (per shape): the warm-up runs of ``forward_fn`` on the capture stream that
    the ``warmup`` policy asks for (``BaseCudaGraphBackend.warmup_runs``),
    ``post_warmup_hook()``, a synchronize, then one recorded run inside
    ``device_module.graph(g, pool=pool, stream=stream)`` (caches emptied only before the
    session's first graph, ``BaseCudaGraphBackend.graph_capture``), all on ``self.device`` (explicit
    synchronize, capture stream made on it; the runner holds its device guard). Replay
    runs on the caller's current stream of that device. The tensors that recorded run
    returned are kept as the shape's output: every replay rewrites them in place, so a
    caller must consume (or copy) an output before the next replay of any graph in the
    pool (sglang ``FullCudaGraphBackend``; PyTorch "CUDA Graphs" notes).

    Args (beyond ``BaseCudaGraphBackend``'s):
        weak_ref_outputs: keep non-owning aliases of each shape's outputs (CUDA only),
            so the shapes share pool memory (:mod:`cuda_graph_runner.weak_ref`). An output
            is valid until the next replay either way.
        compiler: ``"eager"`` (the forward as written) or ``"inductor"`` (compiled full:
            :mod:`cuda_graph_runner_full.compiled`); None reads ``phase_config.tc_compiler``.
        inductor_options: inductor config patches for ``"inductor"`` (None: the defaults
            of :mod:`~cuda_graph_runner_full.compiled`).

    Everything the forward reads must live at the addresses it had at capture: the
    runner's static buffers, the model's weights and KV cache. Data-dependent control
    flow and host syncs inside the forward are frozen or forbidden, as with any graph.
    """

    def __init__(
        self,
        *args: Any,
        weak_ref_outputs: bool = True,
        compiler: Any = None,
        inductor_options: Optional[dict] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.weak_ref_outputs = weak_ref_outputs
        self.compiler = compiler or getattr(self.phase_config, "tc_compiler", None) or "eager"
        #: The compiled forward (``compiler`` inductor), else None; see :mod:`.compiled`.
        self.compiled_forward: Optional[CompiledForward] = None
        if self.compiler != "eager":
            self.compiled_forward = CompiledForward(self.compiler, tag=self.phase, inductor_options=inductor_options)
        #: Seconds of the last compile pass (compiled full), else None.
        self.compile_seconds: Optional[float] = None
        self._graphs: Dict[ShapeKey, Any] = {}
        self._outputs: Dict[ShapeKey, Any] = {}

    def capture_session(self, stream: Any) -> ContextManager[None]:
        return self.bind_capture_stream(stream)

    def prepare(self, runner: Any) -> None:
        """Compiled full: the compile pass over every capture size (:mod:`.compiled`)."""
        if self.compiled_forward is not None:
            self.compile_seconds = self.compiled_forward.compile_pass(runner)
            for size in runner.capture_sizes:
                self.note_kernels_ran(runner.make_key(size))

    def _compiled_active(self) -> ContextManager[None]:
        return self.compiled_forward.active() if self.compiled_forward is not None else contextlib.nullcontext()

    def verify_reference(self, eager_fn: Callable[[], Any], key: ShapeKey, static_batch: ForwardBatch) -> Any:
        """Compiled full: the compiled forward run without the graph (same kernels). The
        live batch is a plain ``ForwardBatch`` where capture saw the runner's static
        batches, so the first verified replay costs Dynamo one more graph (verify mode only)."""
        with self._compiled_active():
            return eager_fn()

    def capture_one(
        self,
        key: ShapeKey,
        forward_fn: ForwardFn,
        *,
        post_warmup_hook: Optional[Callable[[], None]] = None,
    ) -> None:
        """Warm up, then record ``forward_fn`` for ``key``.

        Raises:
            ValueError: ``key`` was already captured (``cleanup()`` first).
        """
        if key in self._graphs:
            raise ValueError(f"shape {key} is already captured; call cleanup() before capturing it again")
        with self._compiled_active():  # compiled full records inductor's kernels
            self.warm_up(forward_fn, post_warmup_hook, key=key)
            graph = self.device_module.CUDAGraph()
            with self.graph_capture(graph):
                output = forward_fn()
        self._graphs[key] = graph
        # Keeping only aliases returns this shape's output blocks to the pool, so smaller
        # shapes captured next reuse them: the pool stays near the largest shape's size
        # instead of the sum of every shape's outputs. Only for memory that really lives
        # in a graph pool (CUDA), never for a fake device's plain tensors.
        keep_weak = self.weak_ref_outputs and self.device.type == "cuda" and _all_on_cuda(output)
        self._outputs[key] = weak_ref_tensors(output) if keep_weak else output

    def can_run(self, batch: ForwardBatch, key: ShapeKey) -> bool:
        return key in self._graphs

    @contextlib.contextmanager
    def replay_session(self) -> Iterator[None]:
        yield

    def replay(self, key: ShapeKey, static_batch: ForwardBatch) -> Any:
        graph = self._graphs.get(key)
        if graph is None:
            raise KeyError(f"no graph captured for {key}; captured: {sorted(self._graphs)}")
        graph.replay()
        return self._outputs[key]

    def cleanup(self) -> None:
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._outputs.clear()

    @property
    def captured_keys(self) -> list:
        """Captured keys, in capture order."""
        return list(self._graphs)


def _all_on_cuda(value: Any) -> bool:
    # Weak aliases are only safe for memory a CUDA graph pool keeps alive (a fake device
    # module in CPU tests captures plain host tensors, which would be freed under them).
    return all(t.device.type == "cuda" for _, t in iter_tensors(value))
