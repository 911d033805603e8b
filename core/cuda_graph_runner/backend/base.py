"""The backend contract: how one shape is recorded into a replayable graph and replayed.

A backend is *mechanism only* (sglang's Runner/Backend split, PR #23906): it records
and replays the shapes a runner gives it. Which sizes to capture, padding, output
slicing and eager fallback are the runner's policy, never the backend's.

Call order, from the runner::

    backend.set_capture_plan(plan)               # what the runner captures (capture_plan.py)
    backend.prepare(plan)                        # once, optional (tc_piecewise compiles here)
    with backend.capture_session(stream):
        for key in sizes, largest first:
            backend.capture_one(key, forward_fn, post_warmup_hook=hook)
    ...
    if backend.can_run(batch, key):
        with backend.replay_session():
            out = backend.replay(key, static_batch)
    backend.cleanup()                            # before recapture or teardown

What the base class already does, so a backend writes only what is its own: both
sessions (``capture_session`` binds the capture stream, ``replay_session`` does
nothing), the table of captured graphs and outputs (:attr:`~BaseCudaGraphBackend.graph_table`:
the "already captured" ``ValueError`` and the ``KeyError`` naming the missing key and the
captured ones), ``can_run`` (the key is in the table), ``cleanup`` (reset and forget every
graph), ``captured_keys``, the warm-up loop (:meth:`~BaseCudaGraphBackend.warm_up`) and,
for a backend whose graph is recorded by ``device_module.graph``, the whole capture
(:meth:`~BaseCudaGraphBackend.record_graph`) and replay (:meth:`~BaseCudaGraphBackend.replay_graph`).
A backend must implement ``capture_one`` and ``replay``; it overrides the rest where its
mechanism differs.

Device and streams: a backend learns its device from ``self.device`` (the runner's
device, given at construction) and reaches it through ``self.device_module``. The
runner makes every call above (``prepare`` included) inside a device guard of
``backend.device`` (``device_module.device(device)``, :func:`cuda_graph_runner.backend.device.device_guard`),
so code that uses the current device (``torch.cuda.graph``'s synchronize and
``empty_cache``, default streams) acts on the backend's device whatever device the
caller had current. Backends still name the device explicitly where they can
(:meth:`BaseCudaGraphBackend.synchronize`, :meth:`~BaseCudaGraphBackend.new_stream`,
:meth:`~BaseCudaGraphBackend.device_guard`); a vendor backend called outside a runner
gets the same guarantee from them. ``replay`` runs on the caller's *current stream of
the backend's device* and must not synchronize the device nor switch to another
stream, so an engine overlapping the next batch's preparation with the GPU's work
(overlap scheduling) keeps its stream ordering.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import sys
import unittest.mock
from typing import TYPE_CHECKING, Any, Callable, ClassVar, ContextManager, Dict, Iterator, List, Optional, Set, Tuple

import torch

from .device import resolve_device
from .forward_batch import ForwardBatch
from .graph_table import CapturedGraphs
from .pool import graph_owned_cublas_workspace

if TYPE_CHECKING:
    from .capture_plan import CapturePlan


@dataclasses.dataclass(frozen=True, order=True)
class ShapeKey:
    """The key of one captured graph.

    Attributes:
        size: batch size (decode runner) or token count (prefill and mixed runners).
        variant: what else changes the recorded kernel sequence, e.g. ``"decode"`` or
            ``"target_verify:4"``; empty when nothing does. Keep keys minimal: each
            extra variant multiplies capture time and graph memory.
        requests: the request axis of a two-dimensional key (plugin API 1.3): the request
            slots of a graph keyed by requests x tokens (the mixed runner's
            ``(requests, tokens)``, vLLM's ``BatchDescriptor(num_reqs, num_tokens)``);
            None for a one-dimensional key. A backend keys its graphs by the whole key
            and needs nothing else for it: the static batch of such a key has
            ``requests`` rows on every request-axis field.
    """

    size: int
    variant: str = ""
    requests: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size <= 0:
            raise ValueError(f"ShapeKey.size must be a positive int, got {self.size!r}")
        if self.requests is not None and (
            not isinstance(self.requests, int) or isinstance(self.requests, bool) or self.requests <= 0
        ):
            raise ValueError(f"ShapeKey.requests must be None or a positive int, got {self.requests!r}")

    @property
    def tokens(self) -> int:
        """The token axis of a two-dimensional key (``size``)."""
        return self.size

    def __repr__(self) -> str:
        # A one-dimensional key prints without the request axis: ``ShapeKey(size=8, variant='decode')``.
        second = "" if self.requests is None else f", requests={self.requests}"
        return f"ShapeKey(size={self.size}, variant={self.variant!r}{second})"


ForwardFn = Callable[[], Any]
#: ``capture_one``'s ``post_warmup_hook``: undoes state the warm-ups mutated (or None).
WarmupHook = Optional[Callable[[], None]]


class BaseCudaGraphBackend(abc.ABC):
    """Base class of every capture mechanism.

    Subclasses implement ``capture_one`` and ``replay`` (the two abstract methods) and
    override any of the other four contract methods (``capture_session``, ``can_run``,
    ``replay_session``, ``cleanup``) whose default does not fit. Constructor arguments are passed by
    keyword by the registry's ``resolve_*_backend``; a subclass that needs more takes
    them as keyword arguments with defaults.

    Args:
        device: the device graphs are captured on (``"cuda:0"``, ``"npu:0"``, ``"cpu"``).
        phase: ``"decode"`` or ``"prefill"``.
        phase_config: the ``PhaseConfig`` of that phase (backends read options such as
            ``tc_compiler`` from it), or None.
        memory_pool: the graph memory-pool handle to capture into; None means the
            process-wide pool of ``device`` (see :mod:`cuda_graph_runner.backend.pool`).
        device_module: the ``torch.cuda``-like module; None means
            ``torch.get_device_module(device)``. Tests pass a recording fake here.
    """

    #: The registry name: ``resolve_*_backend`` sets it on each instance it builds (never
    #: on the class, which an alias may share); informational.
    name: ClassVar[str] = ""
    #: Forward runs before each capture (JIT kernels, cuBLAS workspaces, allocator growth).
    num_warmups: ClassVar[int] = 2
    #: Where model code reading a host value of the batch (``seq_lens_cpu``, ...) during
    #: capture is an error (:mod:`cuda_graph_runner.backend.host_guard`): ``"forward"`` (the whole
    #: recorded forward, marked ops included; the default, right for any backend that
    #: records the forward as one graph), ``"outside_marked_ops"`` (marked ops run eagerly
    #: at replay), ``"trace"`` (only while torch.compile traces), ``"off"``.
    host_value_guard: ClassVar[str] = "forward"
    #: Record CUDA-graph kernel annotations in :meth:`graph_capture` (``enable_annotations``
    #: of ``torch.cuda.graph``); the runner turns it on where torch offers them
    #: (:mod:`cuda_graph_runner.backend.profiling`).
    kernel_annotations: bool = False
    #: True when the graph records the model's marked eager ops (attention) in every mode,
    #: EXTEND included (``full``): a prefill runner then fixes the request axis per graph
    #: (request slots, padded with zero-length requests) and needs the model's replay
    #: hook ``init_forward_metadata_replay`` to update the attention metadata outside the
    #: graph. False: marked ops run eagerly at replay on the live requests.
    records_marked_ops: ClassVar[bool] = False

    def __init__(
        self,
        device: "torch.device | str" = "cuda",
        *,
        phase: str = "decode",
        phase_config: Any = None,
        memory_pool: Any = None,
        device_module: Any = None,
    ) -> None:
        # "cuda" means the current device *now*: resolved once, so a later change of the
        # current device never moves this backend's graphs.
        self.device = resolve_device(device, device_module)
        self.phase = phase
        self.phase_config = phase_config
        self._memory_pool = memory_pool
        self._device_module = device_module
        #: Keys whose kernels this backend already ran outside a warm-up (see
        #: :meth:`note_kernels_ran`); the ``auto`` warm-up policy skips their warm-ups.
        self._kernels_ran: Set[ShapeKey] = set()
        self.new_capture_session()

    @property
    def device_module(self) -> Any:
        """``torch.cuda``, ``torch.npu``, ... for ``self.device`` (never a ``torch.cuda`` literal)."""
        if self._device_module is None:
            self._device_module = torch.get_device_module(self.device)
        return self._device_module

    @property
    def memory_pool(self) -> Any:
        """The graph memory-pool handle captures go into: the one given at construction,
        else the device's shared pool (looked up each time, not kept: the runner gives the
        shared pool back when no graph uses it, and the next capture gets a new one)."""
        if self._memory_pool is not None:
            return self._memory_pool
        from .pool import get_global_graph_memory_pool

        self._pool_in_use = get_global_graph_memory_pool(self.device, self.device_module)
        return self._pool_in_use

    # -- helpers for subclasses -------------------------------------------------------
    #: The stream of the capture session in progress (None outside one, or on a device
    #: without streams); set by :meth:`bind_capture_stream`.
    capture_stream: Any = None
    #: The shared pool handle :attr:`memory_pool` last gave out (for graph_memory_bytes).
    _pool_in_use: Any = None
    # Per capture session (new_capture_session): sizes warmed up, graphs begun.
    _session_sizes: int = 0
    _session_graphs: int = 0

    #: Set by the runner while a capture step continues the capture session an earlier
    #: step of the same capture began (``capture: eager_first``): :meth:`bind_capture_stream`
    #: then keeps the session's warm-up and cache-emptying state.
    continue_capture_session: bool = False

    @contextlib.contextmanager
    def bind_capture_stream(self, stream: Any) -> Iterator[None]:
        """What most ``capture_session`` implementations need: remember ``stream`` for
        the session (``self.capture_stream``); the session's warm-up and cache-emptying
        state starts afresh (:meth:`new_capture_session`), unless the runner continues a
        session (:attr:`continue_capture_session`)."""
        self.capture_stream = stream
        if not self.continue_capture_session:
            self.new_capture_session()
        try:
            yield
        finally:
            self.capture_stream = None

    def new_capture_session(self, warmup: Optional[str] = None) -> None:
        """Forget which sizes of the current session warmed up and which graphs began: the
        next size is the session's first (full warm-up, caches emptied before its graph).
        The runner calls it before every capture session with its config's ``warmup``
        policy, which then wins over the backend's own ``phase_config``; so does
        :meth:`bind_capture_stream` (keeping the policy)."""
        self._session_sizes = 0
        self._session_graphs = 0
        if warmup is not None:
            self._warmup_override = warmup

    _warmup_override: Optional[str] = None

    @property
    def warmup_policy(self) -> str:
        """``auto``, ``every_size`` or ``first_size`` (:data:`cuda_graph_runner.config.WARMUP_POLICIES`):
        the runner's (``new_capture_session``), else the ``warmup`` key of this backend's
        phase config, else ``auto``."""
        return self._warmup_override or getattr(self.phase_config, "warmup", None) or "auto"

    def note_kernels_ran(self, key: ShapeKey) -> None:
        """Record that this backend already ran ``key``'s kernels outside a warm-up (a
        compile pass over every size): under the ``auto`` policy that size needs no
        warm-up of its own (vLLM warms compiled sizes up during compilation)."""
        if "_kernels_ran" not in self.__dict__:  # a subclass that skipped __init__
            self._kernels_ran = set()
        self._kernels_ran.add(key)

    def warmup_runs(self, key: Optional[ShapeKey] = None) -> int:
        """How many warm-up runs precede the capture of ``key``; counts ``key`` as the
        session's next size (call once per size, before its warm-ups).

        The session's first size: ``num_warmups`` under every policy (JIT compilation,
        cuBLAS workspaces and allocator growth happen there, on the capture stream).
        Later sizes: ``every_size`` ``num_warmups`` (sglang's two per size);
        ``first_size`` none; ``auto`` one (vLLM's default ``cudagraph_num_of_warmups``),
        none when :meth:`note_kernels_ran` recorded ``key``.
        """
        first = self._session_sizes == 0
        self._session_sizes += 1
        policy = self.warmup_policy
        if first or policy == "every_size":
            return self.num_warmups
        if policy == "first_size" or (key is not None and key in self.__dict__.get("_kernels_ran", ())):
            return 0
        return min(1, self.num_warmups)

    def annotates_layers(self) -> bool:
        """Whether the runner may open kernel-annotation scopes around the model's layers
        during this backend's capture (:mod:`cuda_graph_runner.backend.profiling`): True only for
        a backend that records the forward, run as Python module calls, into one graph per
        key, so no scope spans two graphs or a compiled trace. False here (``breakable``
        ends graphs inside layers, ``tc_piecewise`` compiles the forward); ``full``
        without ``torch_compile`` says True. Optional: the default is safe."""
        return False

    def graph_capture(self, graph: Any, **options: Any) -> ContextManager[None]:
        """``device_module.graph(graph, pool=self.memory_pool, stream=self.capture_stream,
        **options)``, where only the session's first graph empties the allocator caches.

        ``torch.cuda.graph`` synchronizes and empties the device (and pinned host) cache
        on entry; once per graph that costs more than the capture itself, and the next
        size's warm-up then allocates everything again. The first graph of the session
        (the largest size) still frees what the model left cached; the runner empties the
        cache once more after the session. Borrowed from vLLM's CUDA-graph wrapper and
        sglang's piecewise runner, which patch ``empty_cache``/``gc.collect`` out of all
        captures but the first. On CUDA the graph's cuBLAS workspace is allocated in the
        pool (:func:`cuda_graph_runner.backend.pool.graph_owned_cublas_workspace`), so another
        library dropping cuBLAS's cached workspaces never frees memory a replay writes.
        """
        first = self._session_graphs == 0
        self._session_graphs += 1
        dm = self.device_module
        if self.kernel_annotations:  # resolved before capture_end, remapped to the exec graph after
            options.setdefault("enable_annotations", True)
        ctx = dm.graph(graph, pool=self.memory_pool, stream=self.capture_stream, **options)
        return graph_owned_cublas_workspace(ctx if first else _without_cache_emptying(dm, ctx), dm)

    def device_guard(self) -> ContextManager[Any]:
        """Make ``self.device`` current for the block (``device_module.device(device)``);
        a no-op on the CPU or for an index-less device. The runner already enters it
        around every contract call; nesting is harmless."""
        from .device import device_guard

        return device_guard(self.device, self.device_module)

    def synchronize(self) -> None:
        """Wait for all work on ``self.device`` (``device_module.synchronize(device)``),
        never on whichever device happens to be current."""
        from .device import synchronize

        synchronize(self.device, self.device_module)

    def new_stream(self) -> Any:
        """A new stream on ``self.device`` (``device_module.Stream(device=device)``), or
        None on a device without streams."""
        from .device import new_stream

        return new_stream(self.device, self.device_module)

    def on_capture_stream(self) -> ContextManager[Any]:
        """Run the block on the capture stream (a no-op without one)."""
        if self.capture_stream is None:
            return contextlib.nullcontext()
        return self.device_module.stream(self.capture_stream)

    def warm_up(
        self,
        forward_fn: ForwardFn,
        post_warmup_hook: Optional[Callable[[], None]] = None,
        *,
        key: Optional[ShapeKey] = None,
    ) -> int:
        """The warm-ups before a capture: :meth:`warmup_runs` runs of ``forward_fn`` on the
        capture stream (so lazily made workspaces belong to it), after one device
        synchronize (the capture stream must see what the runner wrote on the current
        stream; runs on one stream need none between them), then ``post_warmup_hook()``
        when a warm-up ran, then a synchronize (sglang warms up twice per size; the
        ``warmup`` config key says how often, :meth:`warmup_runs`). Every synchronize
        names ``self.device``. Returns the number of warm-up runs."""
        runs = self.warmup_runs(key)
        self.synchronize()
        if not runs:
            return 0
        for _ in range(runs):
            with self.on_capture_stream():
                forward_fn()
        if post_warmup_hook is not None:
            post_warmup_hook()
        self.synchronize()
        return runs

    # -- optional hooks -------------------------------------------------------------
    #: The runner's :class:`~cuda_graph_runner.backend.capture_plan.CapturePlan` (set before
    #: ``prepare``; kept for replays), None outside a runner.
    capture_plan: "Optional[CapturePlan]" = None

    def set_capture_plan(self, plan: "CapturePlan") -> None:
        """Called by the runner before :meth:`prepare`: keep ``plan`` as :attr:`capture_plan`."""
        self.capture_plan = plan

    def prepare(self, plan: "CapturePlan") -> None:  # noqa: B027 - an optional hook, empty by design
        """Called once by the runner before each capture session, with its capture plan
        (keys, static batches, the forward; :mod:`cuda_graph_runner.backend.capture_plan`).
        Default: nothing. A backend that must run the forward over every size before
        capture (a compile pass) or replace the model's forward
        (``plan.wrap_model_forward``) does it here; it never patches the model itself."""

    def graph_memory_bytes(self) -> Optional[int]:
        """Bytes of the graph memory pool this backend captures into (shared with every
        backend using the same pool), or None where the device cannot tell."""
        pool = self._memory_pool if self._memory_pool is not None else self._pool_in_use
        if pool is None:
            return None
        from .pool import pool_memory_bytes

        return pool_memory_bytes(pool, self.device)

    # -- introspection (runner.describe(); plugin API 1.2) ----------------------------------
    #: Capture each device graph with its template kept (``keep_graph=True``, instantiated
    #: right after capture, so replays are unchanged) so :meth:`describe_graph` can count
    #: its nodes (:mod:`cuda_graph_runner.backend.graph_nodes`); host memory per graph. None: the
    #: environment variable ``CUDA_GRAPH_RUNNER_GRAPH_NODES`` decides (default off).
    keep_graph_templates: Optional[bool] = None

    def wants_graph_templates(self) -> bool:
        """Whether captures keep their graph templates (:attr:`keep_graph_templates`)."""
        if self.keep_graph_templates is not None:
            return bool(self.keep_graph_templates)
        from . import envs

        return bool(envs.get(envs.GRAPH_NODES))

    def new_graph(self, make_graph: Callable[..., Any]) -> Any:
        """``make_graph()`` (``device_module.CUDAGraph``, ...), with ``keep_graph=True`` when
        :meth:`wants_graph_templates` and the graph type takes it; pair it with
        :meth:`finish_graph` after the capture."""
        if self.wants_graph_templates():
            try:
                return make_graph(keep_graph=True)
            except TypeError:  # a graph type (NPU, a fake, an older torch) without keep_graph
                pass
        return make_graph()

    def finish_graph(self, graph: Any) -> None:
        """After capturing ``graph`` made by :meth:`new_graph`: instantiate a kept template
        now, so the first replay does not (torch instantiates such a graph lazily)."""
        if self.wants_graph_templates() and hasattr(graph, "instantiate") and hasattr(graph, "raw_cuda_graph"):
            try:
                graph.raw_cuda_graph()
            except Exception:  # not kept: capture_end instantiated it already
                return
            graph.instantiate()

    def describe_graph(self, key: ShapeKey) -> Dict[str, Any]:
        """Facts about ``key``'s captured graph for ``runner.describe()``, as plain JSON;
        called off the replay path. Default: ``{"nodes", "kernels"}`` of the graph in
        :attr:`graph_table` when it is a CUDA graph whose template was kept
        (:attr:`keep_graph_templates`), else both None; ``{}`` for a key not in the table.
        A backend whose graph is more than one device graph (segments, pieces) overrides
        it and may add its own keys (``breakable``: ``"segments"``, ``"ops_between"``).
        Added in plugin API 1.2; a 1.1 backend gets this default."""
        if key not in self.graph_table:
            return {}
        from .graph_nodes import graph_node_counts

        counts = graph_node_counts(self.graph_table.graph(key))
        return dict(counts) if counts is not None else {"nodes": None, "kernels": None}

    # -- verify mode (cuda_graph_runner.runner.verify) -------------------------------------------
    def verify_reference(self, eager_fn: Callable[[], Any], key: ShapeKey, static_batch: ForwardBatch) -> Any:
        """What a sampled replay of ``key`` is compared with, computed after the replay on the
        same live batch. Default: ``eager_fn()``, the runner's eager forward of the live
        batch (same output structure as the runner's replay output).

        It repeats the forward's side effects (the KV-cache writes of this step, with the
        same values): verify mode needs a forward whose side effects are idempotent for a
        repeated step. A backend whose replay numerics differ by design may return another
        reference (the same compiled code run without graphs, for instance).
        """
        return eager_fn()

    def verify_tolerance(self, dtype: torch.dtype) -> Tuple[float, float]:
        """``(atol, rtol)`` for comparing a replay with :meth:`verify_reference`, elementwise
        ``|replay - reference| <= atol + rtol * |reference|`` for floating-point outputs
        (integer and bool outputs, token ids, are compared exactly); ``dtype`` is the model's
        compute dtype. Default: near-exact for the dtype (the graph runs the same kernels as
        eager; only the padded shape may pick another GEMM algorithm):
        float64 1e-6, float32 1e-4 / 1e-3, float16 1e-2, bfloat16 5e-2."""
        return default_verify_tolerance(dtype)

    # -- the contract -----------------------------------------------------------------
    def capture_session(self, stream: Any) -> ContextManager[None]:
        """Context wrapping the runner's whole capture loop. Default:
        :meth:`bind_capture_stream` (``self.capture_stream`` is ``stream`` inside it, and
        the session's warm-up state starts afresh).

        Args:
            stream: the side stream captures run on, made on ``self.device``
                (:func:`cuda_graph_runner.backend.pool.get_capture_stream`), or None where the
                device has no streams (a backend that needs one makes it with
                :meth:`new_stream`, never a bare ``Stream()`` on the current device).
        """
        return self.bind_capture_stream(stream)

    @abc.abstractmethod
    def capture_one(
        self,
        key: ShapeKey,
        forward_fn: ForwardFn,
        *,
        post_warmup_hook: Optional[Callable[[], None]] = None,
    ) -> None:
        """Record one shape.

        Runs ``forward_fn`` as often as :meth:`warmup_runs` says (:meth:`warm_up`), then
        ``post_warmup_hook`` (if given: it undoes state the warm-ups mutated), then records
        ``forward_fn`` once (:meth:`record_graph` does all of it for a
        ``device_module.graph`` backend). ``forward_fn`` takes no argument, reads the
        runner's static buffers and returns
        the model output: a tensor, or tensors nested in tuples, NamedTuples, lists,
        dicts and dataclasses (the runner rejects anything else on the first run; walk
        it with :mod:`cuda_graph_runner.backend.nested`, never with a container check of your
        own). The backend keeps that output's storage so later replays write into it.

        ``forward_fn`` is bound to the *capture* batch (``plan.static_batch(key)``, pad
        values): a backend that does not record a graph must not call it at replay, or
        every replay computes the dummy batch again (right by accident for decode, whose
        live batch lands in the same buffers, wrong for prefill, whose per-request
        metadata lives in the batch object). At replay, run
        ``self.capture_plan.forward(static_batch)`` instead.

        Raises:
            ValueError: ``key`` was already captured (``graph_table.check_new``).
        """

    def can_run(self, batch: ForwardBatch, key: ShapeKey) -> bool:
        """Whether ``key`` has a graph this backend can replay for ``batch``. Default:
        ``key in self.graph_table``."""
        return key in self.graph_table

    def replay_session(self) -> ContextManager[None]:
        """Context wrapping replay-time model code (backends set their flags here).
        Default: nothing."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def replay(self, key: ShapeKey, static_batch: ForwardBatch) -> Any:
        """Replay the graph of ``key`` and return its output.

        ``static_batch`` views the runner's static buffers, already filled with the live
        batch and padded to ``key.size``.

        Output lifetime (one contract for every backend): the returned output, with the
        structure ``forward_fn`` returned at capture, must stay valid until the next
        replay of any graph in the same pool, and may be overwritten then. ``full``,
        ``breakable`` and ``npu`` return the tensors of the capture, in graph memory
        (zero-copy); a backend may return fresh tensors instead (``tc_piecewise`` decode
        logits are computed eagerly), which satisfies the contract too. A backend never
        copies for the caller: a runner built with ``owned_outputs=True`` clones what
        shares memory with this output, once.

        Runs on the caller's current stream of ``self.device`` (the runner holds a device
        guard of it): no device synchronize, no switch to a side or default stream.

        Raises:
            KeyError: no graph was captured for ``key``.
        """

    def cleanup(self) -> None:
        """Drop every graph and output (``graph.reset()``); the backend can capture again.
        Default: ``self.graph_table.clear()``."""
        self.graph_table.clear()

    def discard(self, key: ShapeKey) -> None:
        """Drop ``key``'s graph and output, whole or half made, so ``key`` can be captured
        again; nothing when ``key`` holds none. The runner calls it when a capture step
        failed (on this rank or on another rank of a TP group: every rank then keeps the
        same graphs). Default: ``self.graph_table.discard(key)``; a backend that keeps
        per-key state elsewhere drops that too."""
        self.graph_table.discard(key)

    # -- the shared mechanics on the graph table ------------------------------------------
    @property
    def graph_table(self) -> CapturedGraphs:
        """This backend's :class:`~cuda_graph_runner.backend.graph_table.CapturedGraphs`."""
        table = self.__dict__.get("_graph_table")
        if table is None:  # made on first use: a subclass may skip __init__
            table = self.__dict__["_graph_table"] = CapturedGraphs()
        return table

    @property
    def captured_keys(self) -> List[ShapeKey]:
        """Captured keys, in capture order."""
        return self.graph_table.keys()

    def record_graph(
        self,
        key: ShapeKey,
        forward_fn: ForwardFn,
        make_graph: Callable[[], Any],
        post_warmup_hook: Optional[Callable[[], None]] = None,
        *,
        weak_ref_outputs: bool = False,
        **options: Any,
    ) -> Any:
        """The whole ``capture_one`` of a backend recording one ``device_module.graph``:
        refuse a key captured twice, :meth:`warm_up`, record ``forward_fn`` into a new
        ``make_graph()`` (``device_module.CUDAGraph``, ...) inside :meth:`graph_capture`
        (``options`` go to ``device_module.graph``), keep ``(graph, output)`` in
        :attr:`graph_table`. Returns the output.

        Args:
            weak_ref_outputs: keep non-owning aliases of the output when it all lives in
                CUDA graph memory (:meth:`output_to_keep`).

        Raises:
            ValueError: ``key`` was already captured.
        """
        self.graph_table.check_new(key)
        self.warm_up(forward_fn, post_warmup_hook, key=key)
        graph = self.new_graph(make_graph)
        with self.graph_capture(graph, **options):
            output = forward_fn()
        self.finish_graph(graph)
        self.graph_table.add(key, graph, self.output_to_keep(output, weak_ref_outputs))
        return output

    def output_to_keep(self, output: Any, weak_ref: bool) -> Any:
        """``output``, or with ``weak_ref`` non-owning aliases of its tensors
        (:mod:`cuda_graph_runner.backend.weak_ref`) when every tensor is in CUDA memory: the
        shape's output blocks go back to the pool, so smaller shapes captured next reuse
        them and the pool stays near the largest shape's size (sglang's
        ``weak_ref_tensors``). Never for another device's plain tensors (a fake device
        module in CPU tests), which would be freed under the aliases."""
        from .nested import iter_tensors
        from .weak_ref import weak_ref_tensors

        if weak_ref and self.device.type == "cuda" and all(t.device.type == "cuda" for _, t in iter_tensors(output)):
            return weak_ref_tensors(output)
        return output

    def replay_graph(self, key: ShapeKey) -> Any:
        """Replay ``key``'s graph (``graph.replay()``) and return its kept output.

        Raises:
            KeyError: no graph was captured for ``key`` (names the captured keys).
        """
        graph, output = self.graph_table.get(key)
        graph.replay()
        return output


@contextlib.contextmanager
def _without_cache_emptying(device_module: Any, ctx: ContextManager[Any]) -> Iterator[None]:
    """Enter ``ctx`` (a ``graph(...)`` context) with the device module's ``empty_cache`` and,
    for ``torch.cuda``, the pinned host cache's ``_host_emptyCache`` made no-ops; exit it
    normally. Patched only while entering: nothing else runs with them replaced."""
    noop = lambda *args, **kwargs: None  # noqa: E731
    with contextlib.ExitStack() as stack:
        if hasattr(device_module, "empty_cache"):
            stack.enter_context(unittest.mock.patch.object(device_module, "empty_cache", noop))
        if device_module is getattr(torch, "cuda", None) and hasattr(torch._C, "_host_emptyCache"):
            stack.enter_context(unittest.mock.patch.object(torch._C, "_host_emptyCache", noop))
        ctx.__enter__()
    try:
        yield
    except BaseException:
        if not ctx.__exit__(*sys.exc_info()):
            raise
    else:
        ctx.__exit__(None, None, None)


def default_verify_tolerance(dtype: torch.dtype) -> Tuple[float, float]:
    """The base backend's ``(atol, rtol)`` per compute dtype (see ``verify_tolerance``)."""
    return {
        torch.float64: (1e-6, 1e-6),
        torch.float32: (1e-4, 1e-3),
        torch.float16: (1e-2, 1e-2),
        torch.bfloat16: (5e-2, 5e-2),
    }.get(dtype, (1e-4, 1e-3))


def compiled_verify_tolerance(dtype: torch.dtype) -> Tuple[float, float]:
    """``(atol, rtol)`` of a backend whose graph runs inductor's kernels, compared with eager:
    ten times :func:`default_verify_tolerance` (float32 1e-3 / 1e-2, bfloat16 0.5 / 0.5).
    Inductor fuses and reorders reductions and keeps fused intermediates in float32, so a
    bfloat16 logit may differ from eager's by an ulp (0.12 at 16; the H200 measured 0.121 /
    0.133 on llama-3.2-1b) without anything being wrong."""
    atol, rtol = default_verify_tolerance(dtype)
    return atol * 10, rtol * 10


class DisabledBackend(BaseCudaGraphBackend):
    """Backend ``disabled``: captures nothing, so the runner runs every batch eagerly.

    Built into the core so that a config can always say "no graphs", on any device.
    """

    name = "disabled"
    num_warmups = 0
    host_value_guard = "off"

    def capture_one(self, key: ShapeKey, forward_fn: ForwardFn, *, post_warmup_hook=None) -> None:
        return None

    def replay(self, key: ShapeKey, static_batch: ForwardBatch) -> Any:
        raise KeyError(f"backend 'disabled' holds no graph (asked for {key})")
