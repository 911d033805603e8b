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
import contextlib
import logging
import time
import weakref
from typing import Any, Callable, ClassVar, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ..backend import profiling
from ..backend.base import BaseCudaGraphBackend, DisabledBackend, ShapeKey
from ..backend.buffers import CudaGraphBufferRegistry
from ..backend.capture_plan import build_capture_plan, capture_static_batch
from ..backend.context import forward_context
from ..backend.device import device_guard, resolve_device, synchronize
from ..backend.errors import CudaGraphVerifyError
from ..backend.forward_batch import ForwardBatch, ForwardMode
from ..backend.host_guard import SCOPE_OFF, SCOPE_TRACE, host_value_guard, missing_extra_error
from ..backend.nested import check_structure, clone_tensors
from ..backend.pool import get_capture_stream, release_unused_graph_memory_pool
from ..backend.profiling import eager_range_name, profiler_enabled, replay_range_name
from ..config import ConfigInput, PhaseConfig, as_config
from . import sleep as sleep_mode
from .arguments import check_backend_arg, claim_backend, model_device
from .capture_gc import freeze_gc
from .capture_report import CaptureOutOfMemoryError, CaptureReport, device_memory_info, find_out_of_memory
from .data_parallel import StepAgreement, dp_forward, start_step_agreement
from .decision import Decision, EagerDecision, ReplayDecision
from .distributed import TensorParallelMismatchError, TensorParallelStepError, TPGroup, tp_agree, tp_capture_step
from .dp_group import DPGroup
from .lazy_capture import BLOCKING, EAGER_FIRST, CaptureStep, LazyCapture, check_budget, empty_step
from .model_protocol import GraphModel
from .sizes import get_batch_sizes_to_capture, output_layout, pad_list, slice_output, slice_rows
from .stats import (
    REASON_ASLEEP,
    REASON_DISABLED,
    REASON_EMPTY,
    REASON_NOT_CAPTURED,
    REASON_NOT_CAPTURED_YET,
    REASON_OTHER_RANK,
    REASON_TOO_LARGE,
    REASON_VARIANT,
    RunStats,
)
from .weights import WeightsFingerprint, check_fingerprint


def key_label(key: ShapeKey) -> str:
    """``"4|decode"``: a key as describe() and the logs name it (size, then variant); a
    two-dimensional key leads with its requests: ``"8x256|mixed"`` (requests x tokens)."""
    size = str(key.size) if key.requests is None else f"{key.requests}x{key.size}"
    return f"{size}|{key.variant}" if key.variant else size


# Re-exported: the subclasses and callers import these from here.
__all__ = [
    "MAX_REPLAY_PLANS",
    "BaseCudaGraphRunner",
    "ReplayDecision",
    "freeze_gc",
    "get_batch_sizes_to_capture",
    "pad_list",
    "slice_rows",
]

logger = logging.getLogger(__name__)

#: Most replay plans (one per live size seen) a runner keeps before starting afresh.
MAX_REPLAY_PLANS = 4096


# The live runners of each model (weak both ways), so one runner's cleanup() leaves the
# model state that another runner's graphs still use.
_RUNNERS: "weakref.WeakKeyDictionary[Any, weakref.WeakSet[Any]]" = weakref.WeakKeyDictionary()


def _runners_of(model: Any) -> "weakref.WeakSet[Any]":
    try:
        return _RUNNERS.setdefault(model, weakref.WeakSet())
    except TypeError:  # a model that cannot be weakly referenced: only this runner is known
        return weakref.WeakSet()


@contextlib.contextmanager
def _continued_session(backend: BaseCudaGraphBackend, continuing: bool) -> Any:
    """``backend.continue_capture_session`` set to ``continuing`` for the block."""
    backend.continue_capture_session = continuing
    try:
        yield
    finally:
        backend.continue_capture_session = False


class BaseCudaGraphRunner(abc.ABC):
    """Captures a model per size with one backend and replays it per batch.

    Args:
        model: a :class:`~cuda_graph_runner.runner.model_protocol.GraphModel`:
            ``forward(batch) -> hidden [num_tokens, hidden]`` and
            ``compute_logits(hidden, batch) -> logits`` (float32), plus the optional
            hooks of :mod:`cuda_graph_runner.runner.model_protocol` (``init_forward_metadata``,
            ``init_forward_metadata_capture``, ``init_forward_metadata_replay``,
            ``cleanup_cuda_graph_state``, ``post_warmup_hook``, and for decode
            ``get_cuda_graph_seq_len_fill_value``).
        config: a ``CudaGraphConfig``, this phase's ``PhaseConfig``, a dict in
            ``CudaGraphConfig.from_dict`` form or in one phase's form (``{"backend":
            "full"}``), a backend name, or None (defaults); converted once by
            :func:`cuda_graph_runner.config.as_config`, the same conversion ``resolve`` uses.
        device: where graphs are captured; None means the device of the model's first
            parameter (else first buffer); a model with neither needs it.
        backend: a backend instance, a backend name, or None to resolve the one the
            config names through the registry.
        owned_outputs: return owned copies of replayed outputs (see "Outputs" below);
            None reads the phase config's ``owned_outputs`` key (default False).
        enable_cudagraph_gc: keep the garbage collector running during capture.
        show_progress: progress bar during capture (None: only on a terminal).
        capture_trace_dir: a folder (made when missing) that gets a torch profiler
            trace of each size's capture, one chrome-trace JSON per phase, rank and size
            (:mod:`cuda_graph_runner.backend.profiling`); None (default): no traces.
        kernel_annotations: annotate each kernel the graphs record with the ``nn.Module``
            it ran in, where torch offers CUDA-graph kernel annotations
            (:func:`cuda_graph_runner.backend.profiling.kernel_annotations_available`) and the
            backend records one eager graph per shape (``backend.annotates_layers()``:
            ``full`` without ``torch_compile``); elsewhere logged once and ignored.
            Default False.

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
        and dataclasses (:mod:`cuda_graph_runner.backend.nested`); anything else is rejected at
        capture. Each output tensor leads with the padded token count (one row per token)
        or, in the decode runner, the padded batch size (one row per request: a
        TARGET_VERIFY output beside its per-token logits); a replay cuts each to the live
        tokens or requests, and a tensor leading with neither is rejected at capture
        (:class:`~cuda_graph_runner.runner.sizes.OutputRowsError`); 0-d tensors pass as
        they are. Capture and replay run under ``torch.no_grad()``: outputs carry no
        ``grad_fn``, whatever the caller's grad mode.

    A backend instance belongs to one runner (it holds that runner's capture plan and
    graphs): passing one on which another live runner holds graphs is refused, here and
    at ``capture()``.

    Raises:
        TypeError: ``backend`` is not an instance, a name or None; ``owned_outputs`` not
            a bool or None.
        ValueError: the phase config's ``padded_eager`` is on and the runner class defines
            no ``pad_batch``.
        ValueError: ``backend`` is an instance on which another live runner holds
            graphs (names both).
        ValueError: ``device`` is None and the model has no parameters or buffers.
        cuda_graph_runner.backend.profiling.CaptureTraceError: (a ``ValueError``)
            ``capture_trace_dir`` is not a folder that can be made and written.
        cuda_graph_runner.backend.errors.UnknownBackendError and friends, from resolution.
    """

    phase: ClassVar[str]
    #: The forward mode of the batches this runner captures (what the model's
    #: ``cleanup_cuda_graph_state`` hook is told on ``cleanup()``).
    mode: ForwardMode
    #: Default maximum size when the config gives none.
    default_max_size: ClassVar[int]

    def __init__(
        self,
        model: GraphModel,
        config: ConfigInput = None,
        *,
        device: torch.device | str | None = None,
        backend: BaseCudaGraphBackend | str | None = None,
        owned_outputs: Optional[bool] = None,
        enable_cudagraph_gc: bool = False,
        show_progress: Optional[bool] = None,
        capture_trace_dir: Optional[str] = None,
        kernel_annotations: bool = False,
    ) -> None:
        check_backend_arg(backend)
        if not isinstance(kernel_annotations, bool):
            raise TypeError(f"kernel_annotations={kernel_annotations!r}: must be True or False")
        #: Where each size's capture trace goes (None: not traced).
        self.capture_trace_dir: Optional[str] = (
            None if capture_trace_dir is None else profiling.check_trace_dir(capture_trace_dir)
        )
        self.kernel_annotations = kernel_annotations
        self._annotations_noted = False
        if owned_outputs is not None and not isinstance(owned_outputs, bool):
            raise TypeError(f"owned_outputs={owned_outputs!r}: must be True, False or None (the config's value)")
        self.model: GraphModel = model
        #: The model's TP group (``model.tp_group``, :mod:`cuda_graph_runner.runner.distributed`):
        #: ranks capture in step and agree on every batch's replay-or-eager decision.
        tp = getattr(model, "tp_group", None)
        self.tp_group: Optional[TPGroup] = tp if isinstance(tp, TPGroup) and not isinstance(tp, DPGroup) else None
        #: The model's DP group (``model.dp_group``, :mod:`cuda_graph_runner.runner.dp_group`):
        #: ranks capture in step, and every step pads every rank to the largest live size.
        dp = getattr(model, "dp_group", None)
        self.dp_group: Optional[DPGroup] = dp if isinstance(dp, DPGroup) else None
        if (
            self.dp_group is not None
            and self.dp_group.is_parallel
            and self.tp_group is not None
            and self.tp_group.is_parallel
        ):
            raise ValueError(
                f"the model has a TP group (size {self.tp_group.size}) and a DP group (size "
                f"{self.dp_group.size}); data parallelism combined with tensor parallelism is not supported"
            )
        #: The group capture agrees over (TP or DP; None for one process).
        self.rank_group: Optional[TPGroup] = self.tp_group if self.tp_group is not None else self.dp_group
        # An index-less "cuda" is resolved once: buffers, graphs and replays stay on one device.
        self.device = resolve_device(device) if device is not None else model_device(model, type(self).__name__)
        self.config = as_config(config, self.phase)  # once: resolve gets this object, unconverted
        self.phase_config: PhaseConfig = self.config[self.phase]
        #: Whether replayed outputs are cloned for the caller (see the class docstring).
        self.owned_outputs: bool = bool(self.phase_config.owned_outputs) if owned_outputs is None else owned_outputs
        #: Eager forwards run at the padded size a replay would use (:mod:`.padded_eager`).
        self.padded_eager: bool = bool(getattr(self.phase_config, "padded_eager", False))
        if self.padded_eager and type(self).pad_batch is BaseCudaGraphRunner.pad_batch:
            raise ValueError(
                f"{self.phase} padded_eager is on but {type(self).__name__} defines no pad_batch(batch, padded): "
                "define it (the batch padded as replay_prepare pads it) or turn padded_eager off"
            )
        if isinstance(backend, BaseCudaGraphBackend):
            theirs = backend.device
            if (
                theirs.type == self.device.type
                and None not in (theirs.index, self.device.index)
                and theirs.index != self.device.index
            ):
                raise ValueError(
                    f"backend {backend.name!r} is on {theirs} but the runner's device is {self.device}: "
                    f"build the backend with device={str(self.device)!r} or pass device={str(theirs)!r}"
                )
            claim_backend(backend, self)  # before anything touches it
            self.backend = backend
        else:
            from ..registry import get_registry

            # A name given here overrides the config's backend, not its other options (tc_compiler).
            # The whole config, not the PhaseConfig: option checks at resolve need its sources.
            selection = self.config.with_phase(self.phase, backend=backend) if isinstance(backend, str) else self.config
            self.backend = get_registry().resolve(self.phase, selection, device=self.device)
            claim_backend(self.backend, self)
        self.enable_cudagraph_gc = enable_cudagraph_gc
        self.show_progress = show_progress
        from .eager_through import eager_through_enabled
        from .verify import Verifier, policy_from

        #: Eager-through mode (:mod:`.eager_through`): replays run the forward eagerly on
        #: the static batch instead of the graph.
        self.eager_through: bool = eager_through_enabled(self.phase_config)
        policy = policy_from(self.phase_config)
        #: Verify mode's state (:mod:`cuda_graph_runner.runner.verify`); None when off (no cost).
        self.verifier: Optional[Verifier] = (
            Verifier(policy, self.phase, self._backend_label(), eager_through=self.eager_through) if policy else None
        )
        self.capture_sizes: List[int] = self.get_sizes_to_capture()
        self.max_size: int = self.capture_sizes[-1]
        self.buffers = CudaGraphBufferRegistry(self.device)
        if not self.is_disabled:  # ``disabled`` never replays: static buffers would be dead memory
            self.init_buffers()
        self.captured_keys: List[ShapeKey] = []
        _runners_of(model).add(self)
        # Replay plans per live size and reused static batches per captured size
        # (subclasses' replay_prepare): built on first use, valid for the runner's
        # lifetime (the static buffers never move).
        self._replay_plans: Dict[int, Any] = {}
        self._replay_statics: Dict[int, Any] = {}
        self._keys: Dict[int, ShapeKey] = {}
        self._targets: Dict[int, Tuple[int, ShapeKey]] = {}  # live size -> (padded, key)
        self._key_objects: Dict[ShapeKey, ShapeKey] = {}  # see same_key
        # Per captured key: what each output tensor's leading dimension counts
        # (sizes.output_layout), learnt at capture; the last one looked up, by identity.
        self._output_layouts: Dict[ShapeKey, tuple] = {}
        self._last_layout: Tuple[Any, tuple] = (None, ())
        # The ``extra`` keys the captured forward looked up and did not find (host_guard):
        # a live batch holding one would replay what the model did without it.
        self._missing_extra: set = set()
        #: ``(batch, variant)`` while ``forward`` replays the batch it decided (see forward).
        self._decided: Optional[Tuple[ForwardBatch, str]] = None
        #: The DP step agreement started for the next forward (start_step_agreement).
        self._step_agreement: Optional[StepAgreement] = None
        #: Replays and eager fallbacks of ``forward`` (:mod:`.stats`; see :meth:`run_stats`).
        self.stats = RunStats()
        self.capture_seconds: Optional[float] = None
        #: Bytes of the graph pool after capture (shared pool: includes other runners'
        #: graphs in it), else the growth of reserved memory over the capture.
        self.capture_memory_bytes: Optional[int] = None
        # The profiler range name of each key's replay (profiling.replay_range_name), made once.
        self._range_names: Dict[ShapeKey, str] = {}
        #: Seconds each captured key's ``capture_one`` took (warm-ups included), for describe().
        self.key_capture_seconds: Dict[ShapeKey, float] = {}
        # Where the weights lived when the graphs were captured (:mod:`..weights`), and
        # every how many replays forward checks them (0: never, nothing on the replay path).
        self._weights: Optional[WeightsFingerprint] = None
        self._weights_every: int = int(getattr(self.phase_config, "check_weights_every", 0) or 0)
        self._weights_due: int = self._weights_every
        #: Set while asleep (:meth:`sleep`): the sizes :meth:`wake` recaptures.
        self.sleep_state: Optional[sleep_mode.SleepState] = None
        self._asleep_raises: bool = getattr(self.phase_config, "forward_asleep", "eager") == "raise"
        # Whether the backend's prepare ran for the graphs held (capture steps run it once).
        self._plan_prepared = False
        #: The ``eager_first`` capture state (:mod:`.lazy_capture`); None under ``blocking``.
        self.lazy_capture: Optional[LazyCapture] = (
            LazyCapture(self) if getattr(self.phase_config, "capture", BLOCKING) == EAGER_FIRST else None
        )

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

        Returns ``(key, static_batch)``; the padded size and key come from
        :meth:`replay_target` (computed once per live size).
        """

    @abc.abstractmethod
    def graph_forward(self, batch: ForwardBatch) -> Any:
        """What one graph records: the model on ``batch`` (inside the forward context)."""

    @abc.abstractmethod
    def finish_output(
        self, graph_output: Any, batch: ForwardBatch, static_batch: ForwardBatch, key: Optional[ShapeKey] = None
    ) -> Any:
        """Turn a replay of ``key`` into the live batch's output (cut off the padding:
        :meth:`live_rows`)."""

    def output_rows(self, size: int) -> Tuple[int, Optional[int]]:
        """``(tokens, requests)`` a graph of captured size ``size`` holds along its outputs'
        leading dimension (requests None: the graph has no request axis)."""
        return size, None

    def _output_layout(self, output: Any, size: int, where: str) -> tuple:
        tokens, requests = self.output_rows(size)
        return output_layout(output, tokens=tokens, requests=requests, where=where)

    def live_rows(self, graph_output: Any, key: Optional[ShapeKey], padded: int, tokens: int, requests: int) -> Any:
        """``graph_output`` of ``key`` (captured size ``padded``) cut to a live batch of
        ``tokens`` tokens and ``requests`` requests, each tensor by what its leading
        dimension counts (learnt at capture; a backend that never ran the capture's
        forward gets it learnt from this first output).

        Raises:
            OutputRowsError: (first replay of such a backend) a tensor leading with
                neither count.
        """
        last = self._last_layout
        if last[0] is key and key is not None:
            layout: tuple = last[1]
        else:
            known = self._output_layouts.get(key) if key is not None else None
            if known is None:
                layout = self._output_layout(graph_output, padded, f"{self.phase} graph output")
                if key is not None:
                    self._output_layouts[key] = layout
            else:
                layout = known
            self._last_layout = (key, layout)
        return slice_output(graph_output, layout, tokens, requests)

    @abc.abstractmethod
    def eager_forward(self, batch: ForwardBatch) -> Any:
        """The same output as ``replay`` would give, computed eagerly."""

    def batch_matches(self, batch: ForwardBatch) -> bool:
        """Whether this runner's graphs are for ``batch``'s mode and layout."""
        return True

    def fits_graphs(self, batch: ForwardBatch) -> bool:
        """Whether the captured graphs can take ``batch`` beyond its size and variant (a
        runner's own per-batch limit, such as prefill's request slots); ``decide`` and the
        data-parallel step's readiness both ask it. True unless a runner says otherwise."""
        return True

    # -- shared mechanics ---------------------------------------------------------------
    @property
    def is_disabled(self) -> bool:
        # isinstance too: an alias registered for DisabledBackend carries its own name.
        return isinstance(self.backend, DisabledBackend) or self.backend.name == "disabled"

    def padded_size(self, size: int) -> int:
        """The smallest captured size >= ``size``.

        Raises:
            ValueError: ``size`` exceeds the largest captured size (``can_run`` is False).
        """
        if size > self.max_size:
            raise ValueError(f"size {size} exceeds the largest captured size {self.max_size}")
        return self.capture_sizes[bisect.bisect_left(self.capture_sizes, size)]

    def decide(self, batch: ForwardBatch) -> Decision:
        """How ``batch`` runs, decided once per batch (``forward`` and ``can_run`` ask it).

        Returns:
            A :class:`~.decision.ReplayDecision` (its size, padded size and graph key; the
            padded size and key come from :meth:`replay_target`, which ``replay_prepare``
            reads too), or an :class:`~.decision.EagerDecision` whose ``reason`` (one of
            :data:`.stats.REASONS`) ``forward`` records in :meth:`run_stats`. The checks,
            in order: graphs held (else ``"disabled"``, ``"asleep"`` or ``"not captured"``;
            under ``capture: eager_first`` a batch whose size is queued goes on), the
            runner's mode, the size (``"empty batch"``, ``"too large"``), the runner's own
            limits (:meth:`batch_limit`), then the backend's ``can_run`` for the key
            (``"not captured yet"`` for a queued size, else ``"variant not captured"``).

        Raises:
            Whatever the model's ``graph_variant`` or the backend's ``can_run`` raised.
        """
        if not self.captured_keys:
            reason = self._uncaptured_reason()
            if reason != REASON_NOT_CAPTURED or self.lazy_capture is None or not self.lazy_capture.pending():
                return EagerDecision(reason)
            # capture eager_first: the batch's size may be queued, decided below
        if not self.batch_matches(batch):
            return EagerDecision(REASON_VARIANT)
        size = self.size_of(batch)
        if size <= 0:
            return EagerDecision(REASON_EMPTY)
        if size > self.max_size:
            return EagerDecision(REASON_TOO_LARGE)
        padded, _ = self.replay_target(size)
        if self.has_batch_limits:
            refused = self.batch_limit(batch, size, padded)
            if refused is not None:
                return EagerDecision(refused)
        variant = self.variant_of(batch)
        key = self.variant_key(padded, variant)
        if not self.backend.can_run(batch, key):
            if self.lazy_capture is not None and self.lazy_capture.is_queued(padded):
                return EagerDecision(REASON_NOT_CAPTURED_YET, padded)
            # the backend holds no graph for this variant (or none at all yet)
            return EagerDecision(REASON_VARIANT if self.captured_keys else REASON_NOT_CAPTURED)
        return ReplayDecision(size, padded, key, variant)

    #: Whether :meth:`batch_limit` can refuse a batch (prefill's request slots and padding
    #: cap); False keeps the call off the replay path of runners without such limits.
    has_batch_limits: ClassVar[bool] = False

    def batch_limit(self, batch: ForwardBatch, size: int, padded: int) -> Optional[str]:
        """The reason (one of :data:`.stats.REASONS`) this runner's own limits refuse
        ``batch`` of ``size`` rows padded to ``padded``, or None; asked by :meth:`decide`
        before the backend, only when :attr:`has_batch_limits` is True."""
        return None

    def _uncaptured_reason(self) -> str:
        """Why a runner without graphs has none (off the replay path: asked only then)."""
        if self.is_disabled:
            return REASON_DISABLED
        if self.asleep:
            return REASON_ASLEEP
        return REASON_NOT_CAPTURED

    def _eager_reason(self, decision: Decision) -> str:
        """The reason ``forward`` records for a batch run eagerly after ``decision``: its
        own, or, for a batch this rank could replay, that another rank cannot. A batch its
        queued size will serve (``capture: eager_first``) counts as that size's traffic."""
        if not isinstance(decision, EagerDecision):
            return REASON_OTHER_RANK
        if decision.queued and self.lazy_capture is not None:
            self.lazy_capture.observe(decision.queued)
        return decision.reason

    def replay_target(self, size: int) -> Tuple[int, ShapeKey]:
        """``(padded size, key)`` of live size ``size``: computed on its first batch, then
        looked up (``decide`` and ``replay_prepare`` share it: once per size, not per call).

        Raises:
            ValueError: ``size`` exceeds the largest captured size.
        """
        target = self._targets.get(size)
        if target is None:
            padded = self.padded_size(size)
            key = self.plain_key(padded)
            if len(self._targets) >= MAX_REPLAY_PLANS:  # bounded: token counts can be many
                self._targets.clear()
            target = self._targets[size] = (padded, key)
        return target

    def plain_key(self, padded: int) -> ShapeKey:
        """The key of captured size ``padded`` without a variant (``make_key``), made once
        per size and shared by :meth:`replay_target`, :meth:`key_for_batch` and the
        decode runner's variant keys."""
        key = self._keys.get(padded)
        if key is None:
            key = self._keys[padded] = self.same_key(self.make_key(padded))
        return key

    def same_key(self, key: ShapeKey) -> ShapeKey:
        """The one ``ShapeKey`` object this runner uses for ``key``'s value: capture and
        replay hand backends the same object, so their per-key tables (a tc_piecewise
        replay looks its key up in every piece) hit by identity instead of calling the
        dataclass's ``__eq__`` per lookup."""
        return self._key_objects.setdefault(key, key)

    def can_run(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` can replay a captured graph (else ``forward`` runs it eagerly)."""
        return isinstance(self.decide(batch), ReplayDecision)

    # -- graph variants (runner/variants.py): one graph per size unless a subclass has more
    def capture_variants(self) -> Sequence[str]:
        """Variant labels captured for every size, in order (``("",)``: one graph per size)."""
        return ("",)

    def size_variants(self, size: int) -> Sequence[str]:
        """The variants captured at ``size`` (:meth:`capture_variants` unless a runner's
        keys are not a full grid: the mixed runner's requests x tokens)."""
        return self.capture_variants()

    def capture_prepare_variant(self, size: int, variant: str) -> ForwardBatch:
        """The capture batch of ``size`` in ``variant`` (:meth:`capture_prepare` unless a
        variant changes the batch's shape: the mixed runner's request slots)."""
        return self.capture_prepare(size)

    def make_variant_key(self, size: int, variant: str) -> ShapeKey:
        """The ``ShapeKey`` of captured size ``size`` in ``variant`` (``""``: :meth:`make_key`)."""
        return self.make_key(size)

    def variant_of(self, batch: ForwardBatch) -> str:
        """The graph variant a live ``batch`` replays (``""``: one graph per size). Asked
        afresh for every call: a batch object refreshed in place may need another one."""
        return ""

    def variant_key(self, padded: int, variant: str) -> ShapeKey:
        """The key of captured size ``padded`` in ``variant`` (``""``: :meth:`plain_key`)."""
        return self.plain_key(padded)

    def key_for_batch(self, batch: ForwardBatch, padded: int) -> ShapeKey:
        """The key a live ``batch`` padded to ``padded`` replays (its variant included)."""
        return self.variant_key(padded, self.variant_of(batch))

    def capture(self, sizes: Optional[Sequence[int]] = None) -> CaptureReport:
        """Capture every size (or ``sizes``), largest first, into the shared pool.

        Largest first so each smaller graph reuses blocks the larger ones freed in the
        pool; the pool right after the largest size therefore estimates the graph
        memory (:mod:`cuda_graph_runner.runner.capture_report`: ``capture(sizes=[max_size])``,
        :meth:`graph_memory_bytes`, then ``capture()`` for the rest). Sizes that already
        hold a graph are skipped. Runs under ``torch.no_grad()``. A no-op for backend ``disabled``.
        Under the phase config's ``capture: eager_first`` it only queues the sizes and
        returns a report listing none: :meth:`capture_step` captures them (:mod:`.lazy_capture`).

        Everything happens on the runner's device (its backend's ``device``) whatever
        device is current: the capture stream is made on it, every synchronize names it,
        and the backend's calls run inside its device guard.

        Args:
            sizes: a subset of ``capture_sizes`` (a list of ints, or one int); None means
                all of them.

        Returns:
            A :class:`~cuda_graph_runner.runner.capture_report.CaptureReport`.

        Raises:
            ValueError: ``sizes`` names a size not in ``capture_sizes`` (lists both); another
                live runner holds graphs on this runner's backend instance (names both).
            TypeError: ``sizes`` is not an int or a list of ints.
            cuda_graph_runner.backend.errors.CudaGraphHostValueError: the model read a host value of
                the batch where the graph would freeze it (names the field and the fixes).
            cuda_graph_runner.runner.capture_report.CaptureOutOfMemoryError: the device ran out of
                memory (a ``torch.OutOfMemoryError``; names phase, backend, size, the sizes
                done, the pool so far and the fixes). Captured sizes stay usable.
            cuda_graph_runner.backend.nested.UnsupportedStructureError: the forward returns a type
                the runner cannot slice or copy (named, with its place in the output).
            cuda_graph_runner.runner.sizes.OutputRowsError: (a ``ValueError``) an output
                tensor leads with neither the padded token count nor the padded batch
                size (named by its place in the output).
        """
        if isinstance(sizes, int):
            sizes = [sizes]
        if sizes is not None:
            if not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes):
                raise TypeError(f"sizes={sizes!r}: expected a list of ints from capture_sizes {self.capture_sizes}")
            bad = sorted(set(int(s) for s in sizes) - set(self.capture_sizes))
            if bad:
                raise ValueError(f"sizes {bad} are not among this runner's capture sizes {self.capture_sizes}")
        todo = sorted(
            set(self.capture_sizes if sizes is None else (int(s) for s in sizes))
            - {k.size for k in self.captured_keys},
            reverse=True,
        )
        report = CaptureReport(self.phase, self.backend.name, [], self._captured_sizes(), 0.0)
        if self.is_disabled:
            return report
        claim_backend(self.backend, self)  # another runner may have taken it since construction
        # Before the early return: a rank with nothing left to capture must still meet the
        # others' gather, or a rank that has something to capture would wait for it.
        self._agree_sizes_to_capture(todo)
        if not todo:  # every requested size already holds a graph
            report.pool_bytes = self.backend.graph_memory_bytes()
            return report
        self.sleep_state = None  # a capture while asleep ends the sleep (wake() is this for every size)
        if self.lazy_capture is not None:  # eager_first: capture_step() captures them
            self.lazy_capture.queue(todo)
            return report
        with torch.no_grad():  # a capture-time grad_fn would ride on every replayed output
            return self._capture_sizes(todo, report)

    def _capture_sizes(
        self, todo: List[int], report: CaptureReport, keep_going: Optional[Callable[[int], bool]] = None
    ) -> CaptureReport:
        """Capture ``todo`` in order into ``report``; with ``keep_going`` (a capture step of
        :mod:`.lazy_capture`), each size after the first only if ``keep_going(size)``."""
        from ..backend import progress

        device, module = self._graph_device()
        start = time.perf_counter()
        with device_guard(device, module):
            scope = self.host_value_guard_scope()
            # A backend that traces in prepare (tc_piecewise) freezes what its trace reads.
            # tp_agree: a prepare that fails on one rank fails on every rank, at once.
            with (
                tp_agree(self.rank_group, f"prepare of {self.phase} ({self.backend.name})"),
                host_value_guard(
                    self._backend_label(),
                    self.phase,
                    scope if scope == SCOPE_TRACE else SCOPE_OFF,
                    self._missing_extra,
                ),
                progress.step(
                    f"prepare {self.phase} ({self.backend.name}), compile included",
                    f"prepared {self.phase} ({self.backend.name})",
                    self.show_progress,
                ),
            ):
                # Inside the agreement: moved weights on one rank stop every rank.
                if not self.captured_keys:  # what the graphs about to be recorded read
                    self._weights = WeightsFingerprint.take(self.model)
                elif self._weights is not None:  # no new graph beside ones that read moved weights
                    self.check_weights()
                # A capture step prepares once per capture: the plan covers every size, and
                # a compile pass over all of them per step would cost more than the step.
                if keep_going is None or not self._plan_prepared:
                    plan = build_capture_plan(self)
                    self.backend.set_capture_plan(plan)
                    self.backend.prepare(plan)
                    self._plan_prepared = True
            stream = get_capture_stream(device, module) if device.type != "cpu" else None
            self._synchronize()
            before = (
                module.memory_reserved(device) if module is not None and hasattr(module, "memory_reserved") else None
            )
            # The first size of this session warms up fully and empties the caches; later
            # sizes follow the ``warmup`` policy and keep the cache (BaseCudaGraphBackend).
            # A capture step after the first continues the first one's session: the
            # kernels ran already, and emptying the cache would cost the eager steps.
            continuing = keep_going is not None and bool(self.captured_keys)
            if not continuing:
                self.backend.new_capture_session(getattr(self.phase_config, "warmup", None))
            with (
                _continued_session(self.backend, continuing),
                freeze_gc(self.enable_cudagraph_gc, collect=keep_going is None),
                self.backend.capture_session(stream),
            ):
                for size in progress.bar(
                    todo,
                    desc=f"capture {self.phase} ({self.backend.name})",
                    done=f"captured {len(todo)} {self.phase} graphs ({self.backend.name})",
                    show=self.show_progress if keep_going is None else False,
                ):
                    if keep_going is not None and report.sizes and not keep_going(size):
                        break
                    tp_step = tp_capture_step(self.rank_group, f"{self.phase} size {size}")
                    had = set(self.captured_keys)
                    try:
                        with tp_step, self._capture_tracing(size):  # ranks warm up together
                            self.capture_one_shape(size)
                    except Exception as exc:
                        # A size is captured in every variant on every rank, or in none.
                        self._roll_back(size, had)
                        self._raise_if_out_of_memory(exc, size, todo, device, module)
                        raise
                    report.sizes.append(size)
                    if len(report.sizes) == 1 and keep_going is None:  # a snapshot: not per step
                        report.first_size_pool_bytes = self.backend.graph_memory_bytes()
            self._synchronize()
            # Only the session's first graph emptied the cache: give back what the later
            # sizes' warm-ups left cached (outside the graph pool), once.
            # Not after a capture step: the eager steps between steps reuse what is cached.
            empty_cache = getattr(module, "empty_cache", None) if module is not None and keep_going is None else None
            if empty_cache is not None:
                empty_cache()
        self.capture_seconds = report.seconds = time.perf_counter() - start
        report.compile_seconds = getattr(self.backend, "compile_seconds", None)
        pool_bytes = report.pool_bytes = self.backend.graph_memory_bytes()
        if pool_bytes is not None:
            self.capture_memory_bytes = pool_bytes
        elif before is not None:
            self.capture_memory_bytes = module.memory_reserved(device) - before
        report.captured_sizes = self._captured_sizes()
        memory = self.capture_memory_bytes
        logger.info(
            "captured %d %s graphs with %s in %.2f s (%d graphs held, graph memory %s)%s",
            len(report.sizes),
            self.phase,
            self._backend_label(),
            self.capture_seconds,
            len(self.captured_keys),
            "unknown" if memory is None else f"{memory / 2**20:.1f} MiB",
            ", eager-through mode: replays run the forward eagerly" if self.eager_through else "",
        )
        return report

    def capture_step(self, budget_ms: Optional[float] = None) -> CaptureStep:
        """Capture queued sizes for about ``budget_ms`` milliseconds (``capture:
        eager_first``; :mod:`.lazy_capture`): the sizes live traffic ran eagerly first
        (most batches first), then the others largest first; each size replays from the
        next ``forward`` on, once every variant of it is captured. At least one size per
        call, the next only while the last size's time still fits, so a call may overrun
        the budget by one size; the first call also runs the backend's ``prepare``
        (compile). Under ``blocking``, for backend ``disabled`` or with nothing queued: a
        no-op. Tensor/data parallel: call it on every rank at the same point; every rank
        captures the same sizes.

        Args:
            budget_ms: milliseconds (> 0) to spend; None: every queued size.

        Returns:
            A :class:`~.lazy_capture.CaptureStep`: the sizes captured and their ms, how
            many sizes replay now and how many remain.

        Raises:
            TypeError, ValueError: ``budget_ms`` is not a number > 0 or None (names it).
            TensorParallelMismatchError: the ranks would capture different sizes.
            What :meth:`capture` raises for a size (out of memory, a host read, another
            rank's failure): that size is rolled back and stays queued (eager serves it);
            the sizes captured before it in the same call are kept.
        """
        if self.lazy_capture is None or self.is_disabled:
            check_budget(budget_ms)
            return empty_step(self)
        return self.lazy_capture.step(budget_ms)

    def _capture_tracing(self, size: int) -> Any:
        """The capture trace of ``size`` (when ``capture_trace_dir`` is set) and the layer
        annotations (when ``kernel_annotations`` is on and available) around its capture."""
        if self.capture_trace_dir is None and not self.kernel_annotations:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        if self.capture_trace_dir is not None:
            rank = self.tp_group.rank if self.tp_group is not None else profiling.process_rank()
            stack.enter_context(
                profiling.capture_trace(
                    self.capture_trace_dir, self.phase, self._backend_label(), rank, size, self.backend.device
                )
            )
        if self.kernel_annotations:
            ok, why = profiling.kernel_annotations_available(self.backend.device)
            if ok and not self.backend.annotates_layers():
                ok, why = False, f"backend {self._backend_label()} does not record one eager graph per shape"
            if ok:
                self.backend.kernel_annotations = True  # graph_capture records and remaps them
                stack.enter_context(profiling.annotate_layers(self.model, profiling.annotations_module()))
            elif not self._annotations_noted:  # once per runner
                self._annotations_noted = True
                logger.info("kernel annotations off for %s: %s", self.phase, why)
        return stack

    def _agree_sizes_to_capture(self, todo: List[int]) -> None:
        """Every rank captures the same sizes in the same order, with the same graph
        variants, or none does: ranks that would pair one size's (or variant's)
        collectives with another's raise instead, naming each rank's sizes or variants (a
        capture-time gather; nothing per step). The step agreements rely on it: their
        all-reduce's length follows the number of variants.

        Raises:
            TensorParallelMismatchError: the ranks' sizes to capture, or their graph
                variants, differ.
        """
        tp = self.rank_group
        if tp is None or not tp.is_parallel:
            return
        mine = (list(todo), list(self.capture_variants()))
        got = tp.gather_objects(mine, what=f"the agreement on the {self.phase} sizes to capture", capture=True)
        for part, what, fix in (
            (0, "sizes", "the same config and the same graphs already captured (cleanup() on every rank)"),
            (1, "graph variants", "the same model.graph_variants()"),
        ):
            if any(g[part] != got[0][part] for g in got):
                seen = "; ".join(f"rank {r}: {g[part]}" for r, g in enumerate(got))
                raise TensorParallelMismatchError(
                    f"{tp.kind} ranks would capture different {self.phase} {what} ({seen}); this is rank {tp.rank}; "
                    f"every rank needs {fix}"
                )
        tp.variants_agreed(mine[1])

    def _roll_back(self, size: int, had: Set[ShapeKey]) -> None:
        """Forget what the failed capture step of ``size`` left (every variant's key not
        captured before the step, whole or half made): the backend drops it
        (``backend.discard``) and the runner drops it from its list, so every rank of a TP
        group keeps the same graphs and the next ``capture()`` captures the same sizes."""
        for variant in self.size_variants(size):
            key = self.same_key(self.make_variant_key(size, variant))
            if key in had:
                continue
            try:
                self.backend.discard(key)
            except Exception as exc:  # the capture error being raised matters more
                logger.warning("could not discard %s after a failed capture step: %s", key, exc)
            if key in self.captured_keys:
                self.captured_keys.remove(key)

    def graph_memory_bytes(self) -> Optional[int]:
        """Bytes of the graph memory pool now (shared: other runners' graphs in the same
        pool count too), or None where the device cannot tell. After
        ``capture(sizes=[max_size])`` it estimates the full capture's graph memory, with
        the accuracy stated in :mod:`cuda_graph_runner.runner.capture_report`."""
        return self.backend.graph_memory_bytes()

    def _captured_sizes(self) -> List[int]:
        return sorted({k.size for k in self.captured_keys}, reverse=True)

    def _graph_device(self) -> Tuple[torch.device, Any]:
        # The backend knows the device its graphs live on (and, in tests, a fake module).
        device = self.backend.device
        return device, (self.backend.device_module if device.type != "cpu" else None)

    def _raise_if_out_of_memory(
        self, exc: BaseException, size: int, todo: Sequence[int], device: torch.device, module: Any
    ) -> None:
        oom = find_out_of_memory(exc)
        if oom is None:
            return
        try:
            pool_bytes = self.backend.graph_memory_bytes()
        except Exception:  # a measurement must not hide the error being reported
            pool_bytes = None
        free, total = device_memory_info(device, module)
        done = self._captured_sizes()
        raise CaptureOutOfMemoryError(
            phase=self.phase,
            backend=self.backend.name,
            size=size,
            captured_sizes=done,
            pending_sizes=[s for s in todo if s not in done],
            pool_bytes=pool_bytes,
            free_bytes=free,
            total_bytes=total,
            original=oom,
        ) from exc

    def capture_one_shape(self, size: int) -> None:
        """Capture one size in every variant (:meth:`capture_variants`): build the dummy
        batch, then ``backend.capture_one``; a key already captured is skipped."""
        for variant in self.size_variants(size):
            key = self.same_key(self.make_variant_key(size, variant))
            if key not in self.captured_keys:
                self._capture_one_key(size, variant, key)

    def _capture_one_key(self, size: int, variant: str, key: ShapeKey) -> None:
        batch = capture_static_batch(self, size, variant)
        scope = self.host_value_guard_scope()

        where = f"{self.phase} graph output"

        def forward_fn() -> Any:
            # The guard covers warm-ups too: a read there is a read in the recorded run.
            with (
                forward_context(batch),
                host_value_guard(self._backend_label(), self.phase, scope, self._missing_extra),
            ):
                output = self.graph_forward(batch)
            # Checked on the first (warm-up) run, before anything is recorded.
            check_structure(output, where=where)
            self._output_layouts[key] = self._output_layout(output, size, where)
            self._last_layout = (None, ())
            return output

        start = time.perf_counter()
        self.backend.capture_one(key, forward_fn, post_warmup_hook=getattr(self.model, "post_warmup_hook", None))
        seconds = self.key_capture_seconds[key] = time.perf_counter() - start
        self.captured_keys.append(key)
        logger.info(
            "captured %s graph %s with %s in %.3f s", self.phase, key_label(key), self._backend_label(), seconds
        )

    def replay(self, batch: ForwardBatch) -> Any:
        """Run ``batch`` through its captured graph (under ``torch.no_grad()``).

        Returns:
            The model's output for the live batch (padding sliced off). Zero-copy by
            default: valid until the next replay of any graph in the same pool (the next
            ``forward``/``replay`` of this runner or of one sharing its pool); copy what
            you keep, or build the runner with ``owned_outputs=True`` to get owned copies.

        Runs inside a device guard of the runner's device, on the caller's *current
        stream of that device*: the copies into the static buffers, the graph replay and
        the output slicing are enqueued there, without any synchronize. The output is
        ready when work enqueued after it on that stream runs (or after a synchronize of
        that stream); an engine preparing the next batch on another stream must order it
        after this one (``other.wait_stream(current)``) before touching the outputs.

        Raises:
            ValueError: the batch is larger than the largest captured size.
            KeyError: no graph for its padded size (call ``can_run`` first).
            cuda_graph_runner.backend.errors.CudaGraphVerifyError: verify mode is on and this replay
                differs from the backend's reference on the same batch.
            cuda_graph_runner.backend.errors.CudaGraphHostValueError: the batch's ``extra`` holds a
                key the captured forward looked up and did not find (named): the graph
                would replay what the model did without it.
        """
        device, module = self._graph_device()
        # On the caller's current stream of the runner's device: no synchronize here, so
        # an engine overlapping the next batch's preparation keeps its stream order.
        # forward() already entered no_grad; entering it again costs microseconds per step.
        grad_off = torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext()
        if self._missing_extra:  # empty unless the captured forward looked up a key it lacked
            extra = batch.extra
            for name in self._missing_extra:
                if name in extra:
                    raise missing_extra_error(name, self._backend_label(), self.phase)
        with device_guard(device, module), grad_off:
            key, static_batch = self.replay_prepare(batch)
            if self.eager_through:  # the graph's forward, eagerly, on the same static batch
                with forward_context(static_batch):
                    output = self.graph_forward(static_batch)
            else:
                with forward_context(static_batch), self.backend.replay_session():
                    if profiler_enabled():  # record_function costs host time even with no profiler
                        with torch.profiler.record_function(self._replay_range(key)):
                            output = self.backend.replay(key, static_batch)
                    else:
                        output = self.backend.replay(key, static_batch)
            result = self.finish_output(output, batch, static_batch, key)
            if self.verifier is not None:
                self._verify_replay(key, static_batch, result, batch)
            if self.owned_outputs:
                # Only what shares memory with the graph's output: one copy, none for
                # results the runner already computed eagerly (prefill logits).
                result = clone_tensors(result, aliasing=output)
            return result

    def _verify_replay(self, key: ShapeKey, static_batch: ForwardBatch, result: Any, batch: ForwardBatch) -> None:
        """Verify mode's check of one replay. With a TP or DP group the ranks agree on the
        outcome (one host all-reduce per checked replay, verify mode only), so a mismatch
        on one rank stops every rank at this step instead of leaving the others waiting in
        the next step's collectives.

        Raises:
            CudaGraphVerifyError: this rank's replay differs from its reference.
            TensorParallelStepError: another rank's did (this rank's matched).
        """
        verifier = self.verifier
        assert verifier is not None

        def check() -> None:
            verifier.after_replay(self.backend, self.model, key, static_batch, result, lambda: self.eager(batch))

        group = self.rank_group
        if group is None or not group.is_parallel:
            check()
            return
        error: Optional[CudaGraphVerifyError] = None
        try:
            check()
        except CudaGraphVerifyError as exc:
            error = exc
        if group.all_true(error is None, what=f"verify mode's agreement on the replay of {key}"):
            return
        if error is not None:
            raise error
        raise TensorParallelStepError(
            f"verify mode: the replay of {key} differs from its reference on another {group.kind} rank "
            f"(that rank raises CudaGraphVerifyError naming the difference); this is rank {group.rank} of {group.size}, "
            "whose replay matched"
        )

    def _replay_range(self, key: ShapeKey) -> str:
        name = self._range_names.get(key)
        if name is None:
            name = self._range_names[key] = replay_range_name(self.phase, self._backend_label(), key)
        return name

    def host_value_guard_scope(self) -> str:
        """Where a host read during capture is an error: the backend's ``host_value_guard``
        scope, or ``"off"`` when the phase config says ``host_value_guard: false``
        (:mod:`cuda_graph_runner.backend.host_guard`)."""
        if not getattr(self.phase_config, "host_value_guard", True):
            return SCOPE_OFF
        return getattr(self.backend, "host_value_guard", "forward")

    def _backend_label(self) -> str:
        return self.backend.name or type(self.backend).__name__

    def start_step_agreement(self, batch: Any, *, variant: Optional[str] = None) -> Optional[StepAgreement]:
        """Start the data-parallel agreement of the next :meth:`forward` without waiting
        (:func:`.data_parallel.start_step_agreement`): call it as soon as this rank knows
        its live size, build the step's ``ForwardBatch``, then ``forward(batch)`` waits
        on it, so the agreement's all-reduce overlaps the batch building.

        Args:
            batch: this rank's live size (int: requests for decode, tokens for prefill),
                the step's ``ForwardBatch``, or None (no requests).
            variant: the graph variant the batch will replay, when ``batch`` is a size and
                the runner captures several.

        Returns:
            The started :class:`~.data_parallel.StepAgreement`, or None without a DP group
            of more than one rank (nothing to agree; ``forward`` runs as always).

        Raises:
            ValueError: a bad size or variant (names it and what is accepted; the other
                ranks get DataParallelStepError at their wait).
            RuntimeError: an agreement is already started and not yet used by ``forward``.
        """
        dp = self.dp_group
        if dp is None or not dp.is_parallel:
            return None
        if self._step_agreement is not None:
            raise RuntimeError(
                f"{type(self).__name__}.start_step_agreement: an agreement is already started for the next "
                "forward(); one per step"
            )
        self._step_agreement = start_step_agreement(self, dp, batch, variant=variant)
        return self._step_agreement

    def forward(self, batch: Optional[ForwardBatch]) -> Any:
        """Replay when a graph covers ``batch``, else run it eagerly (both without autograd).

        With a DP group (``model.dp_group``) every rank calls this every step, ``batch``
        None on a rank without requests: :func:`.data_parallel.dp_forward` pads every rank
        to the largest live size and returns this rank's own rows (None when no rank has
        requests). It waits on the agreement :meth:`start_step_agreement` started, or
        runs the agreement itself (blocking) when none was.

        Returns:
            The model's output for ``batch``. A replayed output is valid until the next
            replay of any graph in the same pool unless the runner was built with
            ``owned_outputs=True`` (see :meth:`replay`); an eager one is the model's own.

        Raises:
            ValueError: ``batch`` is None without a DP group.
        """
        if self.dp_group is not None and self.dp_group.is_parallel:
            agreement, self._step_agreement = self._step_agreement, None
            with torch.no_grad():
                return dp_forward(self, self.dp_group, batch, agreement)
        if batch is None:
            raise ValueError("batch=None (a rank without requests) is accepted only with a DP group (model.dp_group)")
        with torch.no_grad():
            if self.tp_group is None:
                decision = self.decide(batch)
                run = isinstance(decision, ReplayDecision)
                if run and self._weights_every:
                    self._weights_tick()
            else:  # one rank replaying while another runs eagerly (or another graph) deadlocks
                decision, run = self._agreed_decision(self.tp_group, batch)
            if run and isinstance(decision, ReplayDecision):  # all ranks replay only if every rank can
                self.stats.record_replay(decision.size)
                # The variant decided for this batch, read by replay_prepare during this
                # call only: nothing can refresh the batch in between, and no batch is
                # kept past its step (a can_run then replay asks the model again).
                self._decided = (batch, decision.variant)
                try:
                    return self.replay(batch)
                finally:
                    self._decided = None
            if self.sleep_state is not None and self._asleep_raises:
                raise sleep_mode.asleep_error(self)
            reason = self._eager_reason(decision)  # the reason of this batch's one decision
            self.stats.record_fallback(reason)
            if profiler_enabled():  # the eager step is named in a trace, as a replay is
                with torch.profiler.record_function(eager_range_name(self.phase, reason)):
                    return self.eager(batch)
            return self.eager(batch)

    def eager(self, batch: ForwardBatch) -> Any:
        """The eager forward of ``batch`` that ``forward`` and verify mode run: :meth:`run_eager`,
        or, with the phase key ``padded_eager``, the batch padded to the captured size a
        replay would use, run eagerly and cut back (:mod:`.padded_eager`), so that replay
        and eager run the same shapes."""
        if self.padded_eager:
            from .padded_eager import padded_eager_size, run_padded_eager

            padded = padded_eager_size(self, batch)
            if padded is not None:
                return run_padded_eager(self, batch, padded)
        return self.run_eager(batch)

    def pad_batch(self, batch: ForwardBatch, padded: int) -> ForwardBatch:
        """A new batch: ``batch`` padded to captured size ``padded`` with the values a replay
        pads with (:mod:`.padded_eager`); each runner defines it."""
        raise NotImplementedError(f"{type(self).__name__} does not pad batches for padded_eager")

    def run_eager(self, batch: ForwardBatch) -> Any:
        """:meth:`eager_forward` of ``batch`` after the model's eager metadata hook
        ``init_forward_metadata(batch)`` (when the model has one and it is not None): every
        eager forward the runner runs (the fallback, verify mode's reference) is planned,
        as capture (``init_forward_metadata_capture``) and replay
        (``init_forward_metadata_replay``) are."""
        init = getattr(self.model, "init_forward_metadata", None)
        if init is not None:
            init(batch)
        return self.eager_forward(batch)

    def _agreed_decision(self, tp: TPGroup, batch: ForwardBatch) -> Tuple[Decision, bool]:
        """This rank's decision for ``batch`` and whether every rank replays (``agree_step``:
        the same size and graph, replay only if all can). A decision that raised here still
        takes part in the agreement, so the other ranks stop too instead of waiting; this
        rank then raises its own error."""
        try:
            decision = self.decide(batch)
            # Checked before the agreement: a rank whose weights moved, or that is asleep
            # and raises, stops every rank instead of leaving them in a collective.
            if isinstance(decision, ReplayDecision) and self._weights_every:
                self._weights_tick()
            if self.sleep_state is not None and self._asleep_raises:
                raise sleep_mode.asleep_error(self)
            size = decision.size if isinstance(decision, ReplayDecision) else self.size_of(batch)
        except Exception as exc:
            try:
                size = self.size_of(batch)
            except Exception:  # the agreement must still run; 0 stands for "no size"
                size = 0
            with contextlib.suppress(TensorParallelStepError):
                tp.agree_step(size, False, failed=f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}")
            raise
        key = decision.key if isinstance(decision, ReplayDecision) else None
        run = tp.agree_step(size, key is not None, key)
        return decision, run and key is not None

    def describe(self) -> Dict[str, Any]:
        """What this runner captured and how it ran, as plain JSON (``cuda-graph-runner
        inspect`` prints it). Off the replay path: it reads what capture and ``forward``
        already counted, and asks the backend about each graph
        (:meth:`~cuda_graph_runner.backend.BaseCudaGraphBackend.describe_graph`).

        Returns:
            ``{"phase", "backend", "mode"`` (``"replay"`` or ``"eager_through"``),
            ``"capture_sizes"``, ``"capture_seconds"`` (whole capture, compile included;
            None before capture), ``"compile_seconds"`` (None: nothing compiled),
            ``"graph_memory_bytes"`` (the pool after capture, shared with the runners in the
            same pool; None where the device cannot tell), ``"replays"``,
            ``"eager_fallbacks"`` ``{reason: count}``, ``"eager_total"``, ``"graphs"``:
            one entry per captured key in capture order ``{"key", "size", "variant",
            "capture_seconds", "replays_of_size"`` (replays padded to this size, every
            variant of it together), then the backend's facts (``full``: ``"nodes"`` and
            ``"kernels"``, None where torch cannot tell; ``breakable``: ``"segments"``,
            ``"ops_between"``...)``}``; a backend whose ``describe_graph`` raises gets
            ``"describe_error"`` instead of its facts.
        """
        summary = self.run_stats()
        replays_of = {p["captured_size"]: p["replays"] for p in summary["padding"]}
        graphs = []
        for key in self.captured_keys:
            entry: Dict[str, Any] = {
                "key": key_label(key),
                "size": key.size,
                **({} if key.requests is None else {"requests": key.requests}),
                "variant": key.variant,
                "capture_seconds": self.key_capture_seconds.get(key),
                "replays_of_size": replays_of.get(key.size, 0),
            }
            try:
                facts = self.backend.describe_graph(key)
            except Exception as exc:  # a plugin's introspection must not break the listing
                facts = {"describe_error": f"{type(exc).__name__}: {exc}"}
            entry.update(facts or {})
            graphs.append(entry)
        return {
            "phase": self.phase,
            "backend": self._backend_label(),
            "mode": "eager_through" if self.eager_through else "replay",
            "capture_sizes": list(self.capture_sizes),
            "capture_seconds": self.capture_seconds,
            "compile_seconds": getattr(self.backend, "compile_seconds", None),
            "graph_memory_bytes": self.capture_memory_bytes,
            "replays": summary["replays"],
            "eager_fallbacks": summary["eager_fallbacks"],
            "eager_total": summary["eager_total"],
            "graphs": graphs,
        }

    def run_stats(self) -> dict:
        """Replays, eager fallbacks by reason and padding waste per captured size of
        ``forward`` calls so far (:meth:`.stats.RunStats.summary`; ``self.stats.reset()``
        starts over), and ``"pool_mib"``: the graph memory of the last capture
        (:attr:`capture_memory_bytes` in MiB; None before a capture or where the device
        cannot tell), so a decode and a prefill runner's summaries show both pools."""
        summary = self.stats.summary(self.capture_sizes)
        mem = self.capture_memory_bytes
        summary["pool_mib"] = None if mem is None else mem / 2**20
        if self.lazy_capture is not None:  # eager_first: how many sizes replay so far
            summary["capture"] = self.lazy_capture.progress()
        return summary

    __call__ = forward

    def cleanup(self) -> None:
        """Drop every graph; ``capture()`` may be called again. The model's
        ``cleanup_cuda_graph_state(mode)`` hook (when present and not None) then drops its
        per-size state of this runner's forward mode (attention plan buffers), so a
        recapture builds it afresh."""
        self._plan_prepared = False  # first: a cleanup that raises midway prepares again
        device, module = self._graph_device()
        with device_guard(device, module):
            self.backend.cleanup()
            if device.type != "cpu":
                release_unused_graph_memory_pool(device, module)
        self.captured_keys.clear()
        self.key_capture_seconds.clear()
        if self.lazy_capture is not None:  # nothing stays queued: capture() queues afresh
            self.lazy_capture.clear()
        self._weights = None
        self.sleep_state = None
        self._missing_extra.clear()
        self._output_layouts.clear()
        self._last_layout = (None, ())
        self.buffers.reset()
        drop = getattr(self.model, "cleanup_cuda_graph_state", None)
        # The model's per-size state of a mode is shared by every runner of that mode on the
        # model (built once, re-planned in place): dropped only when no other runner still
        # replays graphs that point at it.
        others = [r for r in _runners_of(self.model) if r is not self and r.mode == self.mode and r.captured_keys]
        if drop is not None and not others:
            drop(self.mode)

    def _synchronize(self) -> None:
        device, module = self._graph_device()
        if device.type != "cpu":
            synchronize(device, module)  # this device only, never the current one

    # -- weights and sleep (cuda_graph_runner.runner.weights, .sleep) ---------------------------
    def check_weights(self) -> int:
        """Check that every parameter and buffer of the model still lives where the
        graphs read it (:mod:`cuda_graph_runner.runner.weights`: data pointer, shape, stride,
        dtype, device; host-only, about 1 µs per tensor). In-place updates
        (``param.copy_``) pass; re-assigned tensors (``load_state_dict(assign=True)``, a
        new ``nn.Parameter``, ``param.data = ...``, a reloaded module) do not. The phase
        config's ``check_weights_every`` runs it every N replays of :meth:`forward`.

        Returns:
            The number of tensors checked (0 when no graph is held).

        Raises:
            cuda_graph_runner.runner.weights.StaleWeightsError: some moved, vanished or appeared
                since capture (named), with the fixes: update in place, or recapture
                (``cleanup()`` + ``capture()``, or ``sleep()`` + ``wake()``).
        """
        if self._weights is None or not self.captured_keys:
            return 0
        check_fingerprint(self._weights, self.model, phase=self.phase, backend=self._backend_label())
        return len(self._weights)

    def _weights_tick(self) -> None:
        self._weights_due -= 1
        if self._weights_due <= 0:
            self._weights_due = self._weights_every
            self.check_weights()

    @property
    def asleep(self) -> bool:
        """Whether :meth:`sleep` gave the graphs back and :meth:`wake` has not run since."""
        return self.sleep_state is not None

    def sleep(self) -> Optional[int]:
        """Give the graph memory back to the device (:mod:`cuda_graph_runner.runner.sleep`):
        drop every graph, release the shared pool once no graph uses it, empty the
        allocator's cache. While asleep ``forward`` runs eagerly (reason ``"asleep"`` in
        :meth:`run_stats`) or raises ``RunnerAsleepError`` (``forward_asleep: raise``).
        A no-op when already asleep or for backend ``disabled``.

        Returns:
            Bytes of graph pool given back (the pool before less after; shared with other
            runners' graphs), 0 for a no-op, None where the device cannot tell.

        Raises:
            Whatever the backend's or the model's cleanup raised; the runner is asleep
            then anyway (its sizes remembered for :meth:`wake`).
        """
        queued = sorted(self.lazy_capture.pending()) if self.lazy_capture is not None else []
        try:
            return sleep_mode.sleep(self)
        finally:  # eager_first: sizes queued, not captured yet, come back at wake() too
            state = self.sleep_state
            if queued and state is not None:
                state.sizes = sorted(set(state.sizes) | set(queued), reverse=True)

    def wake(self) -> CaptureReport:
        """Capture again every size and variant held before :meth:`sleep` (a no-op report
        when awake). The new graphs read the weights the model has now. Under ``capture:
        eager_first`` those sizes, and the ones still queued at sleep, are queued again
        for :meth:`capture_step` and the report lists none.

        Returns:
            The :class:`~cuda_graph_runner.runner.capture_report.CaptureReport` of the recapture.

        Raises:
            What :meth:`capture` raises; the runner then stays asleep (nothing half
            captured is kept), so ``wake()`` may be called again.
        """
        return sleep_mode.wake(self)
