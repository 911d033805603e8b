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
from ..forward_batch import ForwardBatch
from ..forward_context import forward_context
from ..nested import check_structure, clone_tensors, map_tensors
from ..pool import get_capture_stream

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def freeze_gc(enable_cudagraph_gc: bool = False) -> Iterator[None]:
    """Collect once, then keep the collector off the heap for the capture (sglang's ``freeze_gc``).

    A collection during capture walks every live object between kernel launches and
    can free tensors whose memory a graph is recording; freezing moves the survivors
    out of the collector's reach. ``enable_cudagraph_gc=True`` opts out.

    What the caller froze stays frozen: ``gc.unfreeze()`` thaws *every* frozen object
    and Python cannot thaw only some, so when objects are already frozen on entry
    (``gc.get_freeze_count() > 0``, e.g. an application's pre-fork ``gc.freeze()``)
    automatic collection is switched off for the block instead (``gc.disable()``, then
    the previous ``gc.isenabled()`` state is restored) and nothing is frozen or thawed:
    ``gc.get_freeze_count()`` never grows and falls only as frozen objects are freed.
    """
    gc.collect()
    if enable_cudagraph_gc:
        yield
        return
    frozen_before = gc.get_freeze_count()
    was_enabled = gc.isenabled()
    if frozen_before:
        gc.disable()
    else:
        gc.freeze()
    try:
        yield
    finally:
        if frozen_before:
            if was_enabled:
                gc.enable()
        else:
            gc.unfreeze()  # only what this block froze: nothing was frozen before it
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
    """``t[:rows]`` for every tensor of ``output`` with at least one dimension (views, no
    copy), through tuples, NamedTuples, lists, dicts and dataclasses, rebuilt with the
    same types (:mod:`cuda_graph_runner.nested`); constants and 0-d tensors pass through."""
    return map_tensors(lambda t: t[:rows] if t.dim() > 0 else t, output)


def _model_device(model: Any, runner: str) -> torch.device:
    """The device of ``model``'s first parameter, else of its first buffer.

    Raises:
        ValueError: the model has neither (no silent CPU fallback: a CUDA model without
            parameters would otherwise be captured on the CPU).
    """
    for attr in ("parameters", "buffers"):
        tensors = getattr(model, attr, None)
        if callable(tensors):
            try:
                first = next(iter(tensors()), None)
            except TypeError:
                first = None
            if isinstance(first, torch.Tensor):
                return first.device
    raise ValueError(
        f"{runner}: cannot tell which device to capture on: the model ({type(model).__name__}) has no "
        "parameters or buffers; pass device=, e.g. device='cuda:0'")


def _check_backend_arg(backend: Any) -> None:
    """Raises TypeError for a ``backend=`` that is not an instance, a name or None."""
    if backend is None or isinstance(backend, (str, BaseCudaGraphBackend)):
        return
    accepted = ("a backend instance (a BaseCudaGraphBackend subclass, built with its device and phase), "
                "a backend name (a str such as 'full'), or None for the config's backend")
    if isinstance(backend, type) and issubclass(backend, BaseCudaGraphBackend):
        raise TypeError(f"backend={backend.__name__} is a backend class, not an instance; pass {accepted}")
    raise TypeError(f"backend={backend!r} ({type(backend).__name__}) is not accepted; pass {accepted}")


class BaseCudaGraphRunner(abc.ABC):
    """Captures a model per size with one backend and replays it per batch.

    Args:
        model: an object with ``forward(batch) -> hidden [num_tokens, hidden]`` and
            ``compute_logits(hidden, batch) -> logits`` (float32), plus optional
            ``init_forward_metadata_capture(batch)``,
            ``init_forward_metadata_replay(batch)`` and ``post_warmup_hook()``.
        config: a ``CudaGraphConfig``, this phase's ``PhaseConfig``, a dict in
            ``CudaGraphConfig.from_dict`` form, or None (defaults).
        device: where graphs are captured; None means the device of the model's first
            parameter (else first buffer); a model with neither needs it.
        backend: a backend instance, a backend name, or None to resolve the one the
            config names through the registry.
        owned_outputs: return owned copies of replayed outputs (see "Outputs" below);
            None reads the phase config's ``owned_outputs`` key (default False).
        enable_cudagraph_gc: keep the garbage collector running during capture.
        show_progress: progress bar during capture (None: only on a terminal).

    Outputs (the same contract for every backend):
        By default (zero-copy) a replayed output is valid until the next replay of any
        graph in the same memory pool, i.e. until the next ``forward``/``replay`` of this
        runner or of any runner sharing its pool (sglang and vLLM behave so): a replay
        writes its outputs into graph memory that other shapes reuse. Consume or copy it
        first. Some backends happen to return fresh memory (prefill logits, tc_piecewise
        decode logits); rely only on the contract. With ``owned_outputs=True`` every
        output is the caller's: the tensors that share memory with the graph's output are
        cloned once, after slicing (logits ``[tokens, vocab]`` float32: one copy of that
        size per step). Eager-fallback outputs are the model's own fresh tensors either
        way. Outputs may be tensors or tensors nested in tuples, NamedTuples, lists, dicts
        and dataclasses (:mod:`cuda_graph_runner.nested`); anything else is rejected at
        capture. Capture and replay run under ``torch.no_grad()``: outputs carry no
        ``grad_fn``, whatever the caller's grad mode.

    Raises:
        TypeError: ``backend`` is not an instance, a name or None; ``owned_outputs`` not
            a bool or None.
        ValueError: ``device`` is None and the model has no parameters or buffers.
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
        owned_outputs: Optional[bool] = None,
        enable_cudagraph_gc: bool = False,
        show_progress: Optional[bool] = None,
    ) -> None:
        _check_backend_arg(backend)
        if owned_outputs is not None and not isinstance(owned_outputs, bool):
            raise TypeError(f"owned_outputs={owned_outputs!r}: must be True, False or None (the config's value)")
        self.model = model
        self.device = torch.device(device) if device is not None else _model_device(model, type(self).__name__)
        self.config = _as_config(config, self.phase)
        self.phase_config: PhaseConfig = self.config[self.phase]
        #: Whether replayed outputs are cloned for the caller (see the class docstring).
        self.owned_outputs: bool = bool(self.phase_config.owned_outputs) if owned_outputs is None else owned_outputs
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
        self.capture_sizes: List[int] = self.get_sizes_to_capture()
        self.max_size: int = self.capture_sizes[-1]
        self.buffers = CudaGraphBufferRegistry(self.device)
        if not self.is_disabled:  # ``disabled`` never replays: static buffers would be dead memory
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
        pool. Runs under ``torch.no_grad()``. A no-op for backend ``disabled``.

        Raises:
            cuda_graph_runner.nested.UnsupportedStructureError: the forward returns a type
                the runner cannot slice or copy (named, with its place in the output).
        """
        if self.is_disabled:
            return
        with torch.no_grad():  # a capture-time grad_fn would ride on every replayed output
            self._capture_all()

    def _capture_all(self) -> None:
        from tqdm.auto import tqdm

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
        batch = self.capture_prepare(size)
        key = self.make_key(size)
        init = getattr(self.model, "init_forward_metadata_capture", None)
        if init is not None:
            init(batch)

        where = f"{self.phase} graph output"

        def forward_fn() -> Any:
            with forward_context(batch):
                output = self.graph_forward(batch)
            # Checked on the first (warm-up) run, before anything is recorded.
            check_structure(output, where=where)
            return output

        self.backend.capture_one(key, forward_fn, post_warmup_hook=getattr(self.model, "post_warmup_hook", None))
        self.captured_keys.append(key)

    def replay(self, batch: ForwardBatch) -> Any:
        """Run ``batch`` through its captured graph (under ``torch.no_grad()``).

        Returns:
            The model's output for the live batch (padding sliced off). Zero-copy by
            default: valid until the next replay of any graph in the same pool (the next
            ``forward``/``replay`` of this runner or of one sharing its pool); copy what
            you keep, or build the runner with ``owned_outputs=True`` to get owned copies.

        Raises:
            ValueError: the batch is larger than the largest captured size.
            KeyError: no graph for its padded size (call ``can_run`` first).
        """
        with torch.no_grad():
            key, static_batch = self.replay_prepare(batch)
            with forward_context(static_batch), self.backend.replay_session():
                output = self.backend.replay(key, static_batch)
            result = self.finish_output(output, batch, static_batch)
            if self.owned_outputs:
                # Only what shares memory with the graph's output: one copy, none for
                # results the runner already computed eagerly (prefill logits).
                result = clone_tensors(result, aliasing=output)
            return result

    def forward(self, batch: ForwardBatch) -> Any:
        """Replay when a graph covers ``batch``, else run it eagerly (both without autograd).

        Returns:
            The model's output for ``batch``. A replayed output is valid until the next
            replay of any graph in the same pool unless the runner was built with
            ``owned_outputs=True`` (see :meth:`replay`); an eager one is the model's own.
        """
        with torch.no_grad():
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
