"""``FullCudaGraphBackend``: the whole forward of one shape recorded as one device graph."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Optional, Sequence, Tuple

import torch

from cuda_graph_runner.backend import (
    BaseCudaGraphBackend,
    CapturePlan,
    CudaGraphConfigError,
    ForwardBatch,
    ForwardFn,
    ShapeKey,
    WarmupHook,
    compiled_verify_tolerance,
)

from .compiled import CompiledForward


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
            so the shapes share pool memory (:mod:`cuda_graph_runner.backend.weak_ref`). An output
            is valid until the next replay either way.
        compiler: ``"eager"`` (the forward as written) or ``"inductor"`` (compiled full:
            :mod:`cuda_graph_runner_full.compiled`); None reads ``phase_config.torch_compile``
            (sglang's ``--enable-torch-compile``).
        compile_max_size: the largest size captured from the compiled forward; larger sizes
            capture the forward as written (sglang's ``--torch-compile-max-bs``); None reads
            ``phase_config.compiled_max_bs()`` (default 32, sglang's).
        inductor_options: inductor config patches for ``"inductor"`` (None: the defaults
            of :mod:`~cuda_graph_runner_full.compiled`).
        compile_sizes: sizes compiled with static shapes (``"inductor"`` only); None
            reads ``phase_config.compile_sizes``.

    Raises:
        CudaGraphConfigError: compile sizes given while the compiler is ``"eager"``.
        ValueError: a compiler value that does not compile (:class:`CompiledForward`).

    Everything the forward reads must live at the addresses it had at capture: the
    runner's static buffers, the model's weights and KV cache. Data-dependent control
    flow and host syncs inside the forward are frozen or forbidden, as with any graph.

    Prefill (:attr:`records_marked_ops`): attention is recorded with the rest, so the
    prefill runner gives each token bucket a fixed number of request slots and the
    model's replay hook re-plans the attention metadata before every replay (sglang's
    full prefill graphs).
    """

    records_marked_ops = True

    def __init__(
        self,
        *args: Any,
        weak_ref_outputs: bool = True,
        compiler: Any = None,
        inductor_options: Optional[dict] = None,
        compile_sizes: Optional[Sequence[int]] = None,
        compile_max_size: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.weak_ref_outputs = weak_ref_outputs
        self.compiler = compiler or getattr(self.phase_config, "torch_compile", None) or "eager"
        if compile_max_size is None:
            limit = getattr(self.phase_config, "compiled_max_bs", None)
            compile_max_size = limit() if callable(limit) else None
        #: The compiled forward (``compiler`` inductor), else None; see :mod:`.compiled`.
        self.compiled_forward: Optional[CompiledForward] = None
        if compile_sizes is None:
            compile_sizes = getattr(self.phase_config, "compile_sizes", None)
        if self.compiler != "eager":
            self.compiled_forward = CompiledForward(
                self.compiler,
                tag=self.phase,
                inductor_options=inductor_options,
                static_sizes=compile_sizes or (),
                max_size=compile_max_size,
            )
        elif compile_sizes:
            raise CudaGraphConfigError(
                "needs a compiler: with torch_compile off nothing is compiled",
                phase=self.phase,
                key="compile_sizes",
                value=list(compile_sizes),
                accepted="null, or a list of captured sizes with torch_compile on (compiled full)",
            )
        #: Seconds of the last compile pass (compiled full), else None.
        self.compile_seconds: Optional[float] = None

    def prepare(self, plan: CapturePlan) -> None:
        """Compiled full: the compile pass over every planned key (:mod:`.compiled`)."""
        if self.compiled_forward is not None:
            self.compile_seconds = self.compiled_forward.compile_pass(plan, label=self.name or "full")
            for key in plan.keys:
                if self.compiled_forward.compiles(key.size):
                    self.note_kernels_ran(key)

    def _compiled_active(self, key: Optional[ShapeKey] = None) -> ContextManager[None]:
        if self.compiled_forward is None:
            return contextlib.nullcontext()
        return self.compiled_forward.active(key.size if key is not None else None)

    def annotates_layers(self) -> bool:
        """Layer scopes for kernel annotations: the forward runs as Python module calls
        inside one graph per key, unless it is compiled (module hooks would enter Dynamo's
        trace)."""
        return self.compiled_forward is None

    def warmup_runs(self, key: Optional[ShapeKey] = None) -> int:
        """The policy's count (:meth:`BaseCudaGraphBackend.warmup_runs`), but at least one
        at a compile size: its marked-op bodies may still meet a Dynamo guard they did
        not see in the compile pass (H200: the stride of a size-1 dim of a tensor the
        first layer made), and that recompile must happen in a warm-up, not inside the
        stream capture."""
        runs = super().warmup_runs(key)
        compiled = self.compiled_forward
        if compiled is not None and key is not None and key.size in compiled.static_sizes:
            return max(runs, 1)
        return runs

    def verify_reference(self, eager_fn: Callable[[], Any], key: ShapeKey, static_batch: ForwardBatch) -> Any:
        """Compiled full: the compiled forward run without the graph, on the live
        (unpadded) batch. Always the dynamic-shape graph: a static size's graph would
        recompile for every live size padded to it. The live batch is a plain
        ``ForwardBatch`` where capture saw the runner's static batches, so the first
        verified replay costs Dynamo one more graph (verify mode only)."""
        if self.compiled_forward is not None and not self.compiled_forward.compiles(key.size):
            return eager_fn()  # above the compiled max size: captured as written
        with self._compiled_active():
            return eager_fn()

    def verify_tolerance(self, dtype: torch.dtype) -> Tuple[float, float]:
        """The base's near-exact tolerance; compiled full: inductor's
        (:func:`~cuda_graph_runner.backend.compiled_verify_tolerance`, ten times the base),
        for verify mode (a static size's kernels against the dynamic graph's) and for the
        bench's comparison with eager."""
        if self.compiled_forward is not None:
            return compiled_verify_tolerance(dtype)
        return super().verify_tolerance(dtype)

    def capture_one(self, key: ShapeKey, forward_fn: ForwardFn, *, post_warmup_hook: WarmupHook = None) -> None:
        """Warm up, then record ``forward_fn`` for ``key`` (``record_graph``); compiled
        full records inductor's kernels."""
        with self._compiled_active(key):
            self.record_graph(
                key, forward_fn, self.device_module.CUDAGraph, post_warmup_hook, weak_ref_outputs=self.weak_ref_outputs
            )

    def replay(self, key: ShapeKey, static_batch: ForwardBatch) -> Any:
        """Replay ``key``'s graph; returns the capture's output tensors.

        Raises:
            KeyError: no graph captured for ``key``.
        """
        return self.replay_graph(key)
