"""``BaseCudaGraphRunner``: the policy half of the Runner/Backend split.

A runner owns everything about *which* graphs exist and *how a live batch reaches
one*: the sizes to capture, the static input buffers, dummy batches for capture,
padding a live batch up to a captured size, slicing the outputs back, and running
eagerly whatever no graph covers. The backend it holds owns only how one shape is
recorded and replayed (``cuda_graph_runner.backend``).
"""

from __future__ import annotations

import abc
import bisect
import dataclasses
import contextlib
import gc
import logging
import time
from typing import Any, Callable, ClassVar, Iterator, List, Optional, Sequence, Tuple

import torch

from ..backend import BaseCudaGraphBackend, ShapeKey
from ..buffers import CudaGraphBufferRegistry
from ..config import CudaGraphConfig, PhaseConfig
from ..forward_batch import ForwardBatch, as_static_batch
from ..forward_context import forward_context
from ..host_guard import SCOPE_OFF, SCOPE_TRACE, host_value_guard
from ..pool import get_capture_stream

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def freeze_gc(enable_cudagraph_gc: bool = False) -> Iterator[None]:
    """Collect once, then freeze the heap for the capture (sglang's ``freeze_gc``).

    A collection during capture walks every live object between kernel launches and
    can free tensors whose memory a graph is recording; freezing moves the survivors
    out of the collector's reach. ``enable_cudagraph_gc=True`` opts out.
    """
    gc.collect()
    should_freeze = not enable_cudagraph_gc
    if should_freeze:
        gc.freeze()
    try:
        yield
    finally:
        if should_freeze:
            gc.unfreeze()
            gc.collect()


def get_batch_sizes_to_capture(
    phase_config: PhaseConfig,
    default_max: int,
    default_sizes: Callable[[int], List[int]],
) -> List[int]:
    """The sizes to capture, ascending.

    Explicit ``phase_config.bs`` wins over ``default_sizes(max)``; the list is cut at
    ``phase_config.max_bs`` and ``max_bs`` itself is always captured, even off the
    stride (12, 20, 50), so the largest batch the user allowed never runs eagerly.

    Raises:
        ValueError: no size is left (e.g. every listed size exceeds ``max_bs``).
    """
    max_bs = phase_config.max_bs
    if phase_config.bs:
        sizes = sorted(set(int(s) for s in phase_config.bs))
    else:
        sizes = default_sizes(max_bs if max_bs is not None else default_max)
    if max_bs is not None:
        sizes = [s for s in sizes if s <= max_bs]
        if not phase_config.bs or max_bs not in sizes:
            sizes.append(max_bs)
    sizes = sorted(set(sizes))
    if not sizes or sizes[0] <= 0:
        raise ValueError(f"no positive size to capture (bs={phase_config.bs}, max_bs={max_bs})")
    return sizes


def slice_rows(output: Any, rows: int) -> Any:
    """``output[:rows]`` through tensors, tuples, lists and dicts (views, no copy)."""
    if isinstance(output, torch.Tensor):
        return output[:rows]
    if isinstance(output, (tuple, list)):
        return type(output)(slice_rows(o, rows) for o in output)
    if isinstance(output, dict):
        return {k: slice_rows(v, rows) for k, v in output.items()}
    return output


def _model_device(model: Any) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


class BaseCudaGraphRunner(abc.ABC):
    """Captures a model per size with one backend and replays it per batch.

    Args:
        model: an object with ``forward(batch) -> hidden [num_tokens, hidden]`` and
            ``compute_logits(hidden, batch) -> logits`` (float32), plus optional
            ``init_forward_metadata_capture(batch)``,
            ``init_forward_metadata_replay(batch)`` and ``post_warmup_hook()``.
        config: a ``CudaGraphConfig``, this phase's ``PhaseConfig``, a dict in
            ``CudaGraphConfig.from_dict`` form, or None (defaults).
        device: where graphs are captured; None means the model's parameters' device.
        backend: a backend instance, a backend name, or None to resolve the one the
            config names through the registry.
        enable_cudagraph_gc: keep the garbage collector running during capture.
        show_progress: progress bar during capture (None: only on a terminal).

    Raises:
        cuda_graph_runner.errors.UnknownBackendError and friends, from resolution.
    """

    phase: ClassVar[str]
    #: Default maximum size when the config gives none.
    default_max_size: ClassVar[int]

    def __init__(
        self,
        model: Any,
        config: Any = None,
        *,
        device: Any = None,
        backend: Any = None,
        enable_cudagraph_gc: bool = False,
        show_progress: Optional[bool] = None,
    ) -> None:
        self.model = model
        self.device = torch.device(device) if device is not None else _model_device(model)
        self.config = _as_config(config, self.phase)
        self.phase_config: PhaseConfig = self.config[self.phase]
        if isinstance(backend, BaseCudaGraphBackend):
            self.backend = backend
        else:
            from ..registry import get_registry

            # A name given here overrides the config's backend, not its other options (tc_compiler).
            selection = dataclasses.replace(self.phase_config, backend=backend) if isinstance(backend, str) \
                else self.phase_config
            self.backend = get_registry().resolve(self.phase, selection, device=self.device)
        self.enable_cudagraph_gc = enable_cudagraph_gc
        self.show_progress = show_progress
        from ..verify import Verifier, policy_from

        policy = policy_from(self.phase_config)
        #: Verify mode's state (:mod:`cuda_graph_runner.verify`); None when off (no cost).
        self.verifier: Optional[Verifier] = Verifier(policy, self.phase, self._backend_label()) if policy else None
        self.capture_sizes: List[int] = self.get_sizes_to_capture()
        self.max_size: int = self.capture_sizes[-1]
        self.buffers = CudaGraphBufferRegistry(self.device)
        self.init_buffers()
        self.captured_keys: List[ShapeKey] = []
        self.capture_seconds: Optional[float] = None
        #: Bytes of the graph pool after capture (shared pool: includes other runners'
        #: graphs in it), else the growth of reserved memory over the capture.
        self.capture_memory_bytes: Optional[int] = None

    # -- subclass policy --------------------------------------------------------------
    @abc.abstractmethod
    def get_sizes_to_capture(self) -> List[int]:
        """Sizes (batch sizes or token counts) to capture, ascending."""

    @abc.abstractmethod
    def init_buffers(self) -> None:
        """Register the static input buffers in ``self.buffers``."""

    @abc.abstractmethod
    def make_key(self, size: int) -> ShapeKey:
        """The ``ShapeKey`` of captured size ``size``."""

    @abc.abstractmethod
    def size_of(self, batch: ForwardBatch) -> int:
        """The size of a live batch along this runner's axis."""

    @abc.abstractmethod
    def capture_prepare(self, size: int) -> ForwardBatch:
        """The static dummy batch of ``size`` that capture runs on (views of the buffers)."""

    @abc.abstractmethod
    def replay_prepare(self, batch: ForwardBatch) -> Tuple[ShapeKey, ForwardBatch]:
        """Copy ``batch`` into the static buffers padded to a captured size.

        Returns ``(key, static_batch)``.
        """

    @abc.abstractmethod
    def graph_forward(self, batch: ForwardBatch) -> Any:
        """What one graph records: the model on ``batch`` (inside the forward context)."""

    @abc.abstractmethod
    def finish_output(self, graph_output: Any, batch: ForwardBatch, static_batch: ForwardBatch) -> Any:
        """Turn a replay's output into the live batch's output (slice off the padding)."""

    @abc.abstractmethod
    def eager_forward(self, batch: ForwardBatch) -> Any:
        """The same output as ``replay`` would give, computed eagerly."""

    def batch_matches(self, batch: ForwardBatch) -> bool:
        """Whether this runner's graphs are for ``batch``'s mode and layout."""
        return True

    # -- shared mechanics ---------------------------------------------------------------
    @property
    def is_disabled(self) -> bool:
        return self.backend.name == "disabled"

    def padded_size(self, size: int) -> int:
        """The smallest captured size >= ``size``.

        Raises:
            ValueError: ``size`` exceeds the largest captured size (``can_run`` is False).
        """
        if size > self.max_size:
            raise ValueError(f"size {size} exceeds the largest captured size {self.max_size}")
        return self.capture_sizes[bisect.bisect_left(self.capture_sizes, size)]

    def can_run(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` can replay a captured graph (else ``forward`` runs it eagerly)."""
        if not self.captured_keys or not self.batch_matches(batch):
            return False
        size = self.size_of(batch)
        if size <= 0 or size > self.max_size:
            return False
        return self.backend.can_run(batch, self.make_key(self.padded_size(size)))

    def capture(self) -> None:
        """Capture every size, largest first, into the shared pool.

        Largest first so each smaller graph reuses blocks the larger ones freed in the
        pool. A no-op for backend ``disabled``.
        """
        if self.is_disabled:
            return
        from tqdm.auto import tqdm

        scope = self.host_value_guard_scope()
        # A backend that traces in prepare (tc_piecewise) freezes what its trace reads.
        with host_value_guard(self._backend_label(), self.phase, scope if scope == SCOPE_TRACE else SCOPE_OFF):
            self.backend.prepare(self)
        stream = get_capture_stream(self.device) if self.device.type != "cpu" else None
        module = torch.get_device_module(self.device) if self.device.type != "cpu" else None
        self._synchronize()
        before = module.memory_reserved(self.device) if module is not None and hasattr(module, "memory_reserved") else None
        start = time.perf_counter()
        sizes = sorted(self.capture_sizes, reverse=True)
        with freeze_gc(self.enable_cudagraph_gc), self.backend.capture_session(stream):
            for size in tqdm(sizes, desc=f"capture {self.phase} ({self.backend.name})",
                             disable=None if self.show_progress is None else not self.show_progress,
                             leave=False):
                self.capture_one_shape(size)
        self._synchronize()
        self.capture_seconds = time.perf_counter() - start
        pool_bytes = self.backend.graph_memory_bytes()
        if pool_bytes is not None:
            self.capture_memory_bytes = pool_bytes
        elif before is not None:
            self.capture_memory_bytes = module.memory_reserved(self.device) - before
        logger.info("captured %d %s graphs with %s in %.2f s", len(sizes), self.phase, self.backend.name,
                    self.capture_seconds)

    def capture_one_shape(self, size: int) -> None:
        """Capture one size: build the dummy batch, then ``backend.capture_one``."""
        batch = as_static_batch(self.capture_prepare(size))
        key = self.make_key(size)
        init = getattr(self.model, "init_forward_metadata_capture", None)
        if init is not None:
            init(batch)
        scope = self.host_value_guard_scope()

        def forward_fn() -> Any:
            # The guard covers warm-ups too: a read there is a read in the recorded run.
            with forward_context(batch), host_value_guard(self._backend_label(), self.phase, scope):
                return self.graph_forward(batch)

        self.backend.capture_one(key, forward_fn, post_warmup_hook=getattr(self.model, "post_warmup_hook", None))
        self.captured_keys.append(key)

    def replay(self, batch: ForwardBatch) -> Any:
        """Run ``batch`` through its captured graph.

        Raises:
            ValueError: the batch is larger than the largest captured size.
            KeyError: no graph for its padded size (call ``can_run`` first).
        """
        key, static_batch = self.replay_prepare(batch)
        with forward_context(static_batch), self.backend.replay_session():
            output = self.backend.replay(key, static_batch)
        result = self.finish_output(output, batch, static_batch)
        if self.verifier is not None:
            self.verifier.after_replay(self.backend, self.model, key, static_batch, result,
                                       lambda: self.eager_forward(batch))
        return result

    def host_value_guard_scope(self) -> str:
        """Where a host read during capture is an error: the backend's ``host_value_guard``
        scope, or ``"off"`` when the phase config says ``host_value_guard: false``
        (:mod:`cuda_graph_runner.host_guard`)."""
        if not getattr(self.phase_config, "host_value_guard", True):
            return SCOPE_OFF
        return getattr(self.backend, "host_value_guard", "forward")

    def _backend_label(self) -> str:
        return self.backend.name or type(self.backend).__name__

    def forward(self, batch: ForwardBatch) -> Any:
        """Replay when a graph covers ``batch``, else run it eagerly."""
        if self.can_run(batch):
            return self.replay(batch)
        return self.eager_forward(batch)

    __call__ = forward

    def cleanup(self) -> None:
        """Drop every graph; ``capture()`` may be called again."""
        self.backend.cleanup()
        self.captured_keys.clear()
        self.buffers.reset()

    def _synchronize(self) -> None:
        if self.device.type != "cpu":
            torch.get_device_module(self.device).synchronize()


def _as_config(config: Any, phase: str) -> CudaGraphConfig:
    if config is None:
        return CudaGraphConfig()
    if isinstance(config, CudaGraphConfig):
        return config
    if isinstance(config, PhaseConfig):
        return CudaGraphConfig().with_phase(phase, **_phase_fields(config))
    if isinstance(config, dict):
        return CudaGraphConfig.from_dict(config)
    raise TypeError(f"config must be a CudaGraphConfig, PhaseConfig or dict, got {type(config).__name__}")


def _phase_fields(pc: PhaseConfig) -> dict:
    return {f.name: getattr(pc, f.name) for f in dataclasses.fields(pc)}


def pad_list(values: Optional[Sequence[int]], rows: int, fill: int) -> Optional[List[int]]:
    """A host list padded with ``fill`` up to ``rows`` entries (None stays None)."""
    if values is None:
        return None
    values = list(values)
    return values + [fill] * (rows - len(values))
