"""``TcPiecewiseCudaGraphBackend``: torch.compile split at the marked ops, each piece a CUDA graph per size.

sglang's piecewise CUDA graph backend (``runner_backend/`` and ``compilation/``) and
vLLM's piecewise mode, as a plugin. How it runs:

``prepare(plan)`` (once, before the capture session; the runner's
:class:`~cuda_graph_runner.backend.capture_plan.CapturePlan`)
    Wraps the model's forward through the contract (``plan.wrap_model_forward``; sglang
    ``install_torch_compiled``): while this backend is at work (an *activity* is set:
    compile pass, warm-up, capture, replay) the model's forward is
    ``torch.compile(original_forward, backend=PiecewiseDynamoBackend, fullgraph=True)``;
    otherwise it is the original forward, untouched (so the runner's eager fallback, and
    any other backend on the same model, run the model as written). Then the *compile
    pass*: ``plan.forward`` on ``plan.static_batch(key)`` for every ``plan.keys`` (largest
    first), which compiles and captures nothing. Its duration is ``compile_seconds``.
``capture_one(key, forward_fn)``
    Warms every piece up for ``key`` as often as the ``warmup`` policy says (``auto``:
    once for the session's first size, then never, as the compile pass already ran every
    size), then calls ``forward_fn`` once more to record each piece into its own
    ``CUDAGraph`` in the shared pool on the capture stream (caches emptied only before
    the session's first graph). The
    marked ops (attention) run eagerly between the pieces during both, capture-safe ones
    too (a declared capture-safe mode does not keep an op inside a piece: the split is
    at every marked op, vLLM's ``splitting_ops``).
``replay(key, static_batch)``
    Runs ``plan.forward(static_batch)`` through the compiled forward: each piece
    replays its graph for ``key`` and returns its capture-time outputs (stable
    addresses), the marked ops run eagerly in between on the live batch
    (``get_forward_batch()``), the last piece's output is the model's output.

Direct replay (no Dynamo per step)
    The capture call of each key records what Dynamo handed the split module (the
    graph's flat inputs: the static batch's views, parameters, KV cache, sizes) and how
    the forward's return value is built from the graph's outputs. A replay whose batch
    arguments are the captured ones (same tensors at the same addresses, same scalars)
    calls the split module with those inputs directly: no frame evaluation, no guard
    check, no chance of a guard failure or recompilation while serving, and every piece
    is the one that holds the key's graph. Like a CUDA graph, a replay does not re-run
    the forward's Python, so tensors the forward reads must not be replaced after
    capture (``cleanup()`` and capture again). Anything else (another batch, a forward
    called twice per capture, a return value not made of graph outputs, ``debug``) goes
    through Dynamo.

Dynamic shapes
    Before a compiled call (except replays) dim 0 of every tensor of the batch is
    marked dynamic (``torch._dynamo.mark_dynamic``) when it has at least 2 rows, so the
    first compilation, made at the largest size, serves every size >= 2: Dynamo never
    specializes on the first bucket and never recompiles across sizes. Sizes 0 and 1
    are always specialized by Dynamo (``mark_dynamic`` of a size-1 dim is an error), so
    a capture list containing 1 costs one more compilation, for size 1 alone, made in
    the compile pass; it is never made while serving. The model's forward must read only
    token-axis tensors of the batch (``input_ids``, ``positions``, ``out_cache_loc``):
    Dynamo would guard on anything else it reads (host lists, request counts), which
    is why per-request metadata is read inside marked ops only (Dynamo does not trace
    into them).

Grad mode
    Every compiled call runs under ``torch.no_grad()`` so Dynamo's grad-mode guard is the
    same at compile, capture and replay, whatever the caller's mode.

CPU
    On a device without graphs (``cpu``) capture is off by default
    (``enable_capture=False``): every call runs the compiled pieces, which lets the CPU
    check the compiled model against eager through the real runners.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import time
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch._dynamo

from cuda_graph_runner.backend import (
    BackendUnavailableError,
    BaseCudaGraphBackend,
    CapturePlan,
    CudaGraphHostValueError,
    ForwardBatch,
    ForwardFn,
    ShapeKey,
    WarmupHook,
    as_static_batch,
    compile_cache_scope,
    compiled_verify_tolerance,
    entry_function,
    envs,
    forward_context,
    progress,
)

from . import plugin
from .compiler import PIECE_COMPILERS, CompiledGraph, PiecewiseDynamoBackend
from .errors import TcPiecewiseCompileError, exception_chain
from .piece import Activity, GraphPiece, Mode, activity, current_activity
from .split import SplitGraph, SplitItem

logger = logging.getLogger(__name__)

#: Set to 1 to check, at every replay, that each piece's inputs sit where they sat at capture
#: (parsed by the core's ``envs``: 1/0/true/false/yes/no/on/off).
ENV_DEBUG = plugin.DEBUG


def mark_dynamic_tokens(args: Any, kwargs: Dict[str, Any]) -> None:
    """Mark dim 0 of every tensor (and every tensor field of a dataclass argument such
    as ``ForwardBatch``) dynamic, when it has at least 2 rows (0/1 always specialize)."""

    def mark(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if value.dim() >= 1 and value.shape[0] >= 2:
                torch._dynamo.mark_dynamic(value, 0)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                item = getattr(value, field.name, None)
                if isinstance(item, torch.Tensor):
                    mark(item)

    for value in list(args) + list(kwargs.values()):
        mark(value)


_DECODE_WARNED = False


def _warn_decode_once() -> None:
    """Decode ``tc_piecewise`` captures piecewise here; sglang 0.5.14 had only a placeholder
    that fell back to ``full`` (a deliberate extension: docs/sglang-compat.md)."""
    global _DECODE_WARNED
    if _DECODE_WARNED:
        return
    _DECODE_WARNED = True
    warnings.warn(
        "tc_piecewise for decode captures piecewise graphs here; sglang 0.5.14 runs decode tc_piecewise "
        "as full (use backend full for sglang's behaviour)",
        UserWarning,
        stacklevel=3,
    )


class _NotDirect(Exception):
    """A captured call that a replay cannot repeat without Dynamo (the reason)."""


def _batch_signature(args: tuple, kwargs: Dict[str, Any]) -> tuple:
    """What a direct replay requires to be as captured: every tensor of the arguments (and
    of a dataclass argument's fields) by address, shape, stride and dtype, and every
    scalar field (mode, width); host lists and dicts (per-request metadata, read only by
    marked ops from the forward context) are left out."""
    out: List[Any] = []

    def add(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            out.append((value.data_ptr(), value.shape, value.stride(), value.dtype))
        elif value is None or isinstance(value, (bool, int, float, str, enum.Enum)):
            out.append(value)
        elif isinstance(value, (list, tuple, dict)):
            out.append(type(value))
        else:
            out.append(id(value))

    for value in list(args) + [kwargs[k] for k in sorted(kwargs)]:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out.append(type(value))
            for name in _field_names(type(value)):
                add(getattr(value, name, None))
        else:
            add(value)
    return tuple(out)


_FIELD_NAMES: Dict[type, Tuple[str, ...]] = {}


def _field_names(cls: type) -> Tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def _output_spec(value: Any, outputs: Any) -> Any:
    """How the forward's return value is built from the graph's output tuple: an index
    for each tensor (which must be one of the outputs), constants, tuples and lists.

    Raises:
        _NotDirect: a tensor that is not a graph output, or another container type.
    """
    if isinstance(value, torch.Tensor):
        for i, out in enumerate(outputs if isinstance(outputs, (tuple, list)) else ()):
            if out is value:
                return ("output", i)
        raise _NotDirect("the forward returns a tensor that is not an output of the compiled graph")
    if type(value) in (tuple, list):
        return (type(value), [_output_spec(v, outputs) for v in value])
    if value is None or isinstance(value, (bool, int, float, str)):
        return ("constant", value)
    raise _NotDirect(f"the forward returns a {type(value).__name__}")


def _build_output(spec: Any, outputs: Any) -> Any:
    kind, item = spec
    if kind == "output":
        return outputs[item]
    if kind == "constant":
        return item
    return kind(_build_output(s, outputs) for s in item)


@dataclasses.dataclass
class _DirectReplay:
    """One captured key's call into the split module, repeated by every replay of the key.

    ``args`` are the graph inputs of the capture call: the static batch's views, the
    parameters, the KV cache, sizes; the pieces replay their graphs (which read those
    addresses anyway) and the marked ops get the tensors they got at capture.
    """

    forward: Callable[..., Any]
    args: tuple
    spec: Any
    signature: tuple

    def run(self) -> Any:
        outputs = self.forward(*self.args)
        spec = self.spec
        if spec[0] == "output":  # the usual case: the forward returns one tensor
            return outputs[spec[1]]
        return _build_output(spec, outputs)


class TcPiecewiseCudaGraphBackend(BaseCudaGraphBackend):
    """torch.compile split at the marked ops; each compiled piece captured per size.

    Args (beyond :class:`~cuda_graph_runner.backend.BaseCudaGraphBackend`'s):
        compiler: ``"eager"`` or ``"inductor"``; None reads ``phase_config.tc_compiler``
            (default ``"eager"``).
        enable_capture: record CUDA graphs; None: on unless the device is ``cpu``. Off,
            every call runs the compiled pieces (the CPU tests' mode).
        weak_ref_outputs: keep piece outputs as non-owning aliases (see
            :mod:`~cuda_graph_runner_tc_piecewise.piece`); None: on for real CUDA
            capture, off otherwise (a fake device module, or no pool to keep memory alive).
        debug: check input addresses at every replay; None reads ``$CUDA_GRAPH_RUNNER_TC_PIECEWISE_DEBUG``.
        direct_replay: replay captured keys without Dynamo (see the module docstring);
            None: on unless ``debug`` (which checks the live inputs Dynamo passes).

    Attributes:
        compile_seconds: duration of the last ``prepare()`` (Dynamo trace, split, piece
            compilation and the compile pass's forwards), None before.
        compiled_graphs: every :class:`CompiledGraph` Dynamo asked for, in order (one
            for sizes >= 2, one more when size 1 is captured).
        dynamo_compiles: ``len(compiled_graphs)``.

    Raises:
        ValueError: unknown compiler.
        cuda_graph_runner.backend.errors.BackendUnavailableError: ``inductor`` on CUDA without Triton.
        TcPiecewiseCompileError: (from ``prepare``) torch.compile could not trace the
            model's forward as one graph, or a piece failed to compile; the message names
            the forward or the piece and the op.
        TcPiecewiseRuntimeError: a piece failed while compiling, warming up or capturing.
    """

    #: Call 1 warms the pieces up, call 2 captures them (sglang's tc_piecewise capture_one).
    num_warmups = 1
    #: What Dynamo traces is frozen (direct replay skips its guards); the marked ops and the
    #: decode LM head run eagerly at replay (cuda_graph_runner.backend.host_guard).
    host_value_guard = "trace"

    def __init__(
        self,
        device: "torch.device | str" = "cuda",
        *,
        compiler: Optional[str] = None,
        enable_capture: Optional[bool] = None,
        weak_ref_outputs: Optional[bool] = None,
        debug: Optional[bool] = None,
        direct_replay: Optional[bool] = None,
        **kwargs: Any,  # phase, phase_config, memory_pool, device_module: the base class's
    ) -> None:
        super().__init__(device, **kwargs)
        device_module = kwargs.get("device_module")
        self.compiler = compiler or getattr(self.phase_config, "tc_compiler", None) or "eager"
        if self.phase == "decode":
            _warn_decode_once()
        if self.compiler not in PIECE_COMPILERS:
            raise ValueError(f"unknown tc_compiler {self.compiler!r}; accepted: {', '.join(PIECE_COMPILERS)}")
        if self.compiler == "inductor" and self.device.type == "cuda":
            from torch.utils._triton import has_triton

            if not has_triton():
                raise BackendUnavailableError(
                    "tc_piecewise: tc_compiler 'inductor' on CUDA needs Triton (pip install triton); "
                    "or use tc_compiler 'eager'"
                )
        self.capture_enabled = self.device.type != "cpu" if enable_capture is None else bool(enable_capture)
        if weak_ref_outputs is None:
            weak_ref_outputs = (
                self.capture_enabled
                and self.device.type == "cuda"
                and device_module in (None, getattr(torch, "cuda", None))
            )
        self.weak_ref_outputs = bool(weak_ref_outputs)
        self.debug = envs.get(ENV_DEBUG) if debug is None else bool(debug)
        self.direct_replay = (not self.debug) if direct_replay is None else bool(direct_replay)
        self.compile_seconds: Optional[float] = None
        self.compiled_graphs: List[CompiledGraph] = []
        self._plan: Optional[CapturePlan] = None
        self._model: Any = None
        #: The contract's stand-in for the model's forward (cuda_graph_runner.backend.model_forward).
        self._forward_wrapper: Any = None
        self._compiled: Optional[Callable[..., Any]] = None
        #: Per captured key: how a replay calls the split module directly (None: it cannot).
        self._direct: Dict[ShapeKey, Optional[_DirectReplay]] = {}
        self._graph_calls: Optional[List[Tuple[CompiledGraph, tuple, Any]]] = None

    # -- introspection -------------------------------------------------------------------
    @property
    def dynamo_compiles(self) -> int:
        return len(self.compiled_graphs)

    @property
    def split(self) -> Optional[SplitGraph]:
        """The split of the first (general-size) compiled graph, None before ``prepare``."""
        return self.compiled_graphs[0].split if self.compiled_graphs else None

    @property
    def pieces(self) -> List[GraphPiece]:
        """The :class:`GraphPiece` objects of the first compiled graph, in order."""
        return list(self.compiled_graphs[0].pieces) if self.compiled_graphs else []

    @property
    def direct_keys(self) -> List[ShapeKey]:
        """Captured keys whose replay calls the split module without Dynamo."""
        return [k for k, d in self._direct.items() if d is not None]

    # -- setup -----------------------------------------------------------------------------
    def prepare(self, plan: CapturePlan) -> None:
        """Wrap the model's forward with the compiled one and run the compile pass.

        The compile pass runs ``plan.forward`` once per ``plan.keys`` (largest first) on
        ``plan.static_batch(key)`` inside the forward context: Dynamo traces at the
        largest size with the token axis dynamic; the other sizes check that no
        recompilation happens (size 1, if listed, compiles once more).

        Raises:
            TcPiecewiseCompileError, TcPiecewiseRuntimeError: see the class.
        """
        start = time.perf_counter()
        self._bind(plan)
        self._plan = plan
        # inductor's work is cached on disk across processes (cuda_graph_runner.backend.compile_cache).
        cache = compile_cache_scope() if self.compiler == "inductor" else contextlib.nullcontext()
        keys = list(plan.keys)
        with cache:
            for key in progress.bar(
                keys,
                desc=f"compile {self.phase} (tc_piecewise, {self.compiler})",
                done=f"compiled {self.phase} for {len(keys)} shapes (tc_piecewise, {self.compiler})",
                show=getattr(plan, "show_progress", None),
            ):
                batch = plan.static_batch(key)
                with forward_context(batch), activity(self, Mode.COMPILE, key):
                    plan.forward(batch)
                self.note_kernels_ran(key)  # the ``auto`` warm-up policy need not warm it up again
        self._synchronize()
        self.compile_seconds = time.perf_counter() - start
        logger.info(
            "tc_piecewise (%s, %s): %d Dynamo graph(s), %d pieces, compile pass %.2f s",
            self.phase,
            self.compiler,
            self.dynamo_compiles,
            len(self.pieces),
            self.compile_seconds,
        )

    def _bind(self, plan: CapturePlan) -> None:
        model = plan.model
        if self._model is model:
            return
        if self._model is not None:
            raise RuntimeError("tc_piecewise: this backend is bound to another model; build a new backend")
        self._forward_wrapper = plan.wrap_model_forward(self._run, active=self._is_active)
        self._model = model
        entry = entry_function(self._forward_wrapper.original, f"tc_piecewise_forward_{self.phase}_{id(self):x}")
        # The Dynamo backend lives in Dynamo's cache (out of the garbage collector's reach):
        # it reaches this backend only weakly, so dropping the runner frees everything.
        ref = weakref.ref(self)

        def make_piece(split: SplitGraph, item: SplitItem, compiled: Any) -> GraphPiece:
            owner = ref()
            if owner is None:
                raise RuntimeError("tc_piecewise: the backend was garbage collected")
            return owner._make_piece(split, item, compiled)

        def on_compiled(graph: CompiledGraph) -> None:
            owner = ref()
            if owner is not None:
                owner._on_compiled(graph)

        def on_graph_call(graph: CompiledGraph, args: tuple, outputs: Any) -> None:
            owner = ref()
            if owner is not None and owner._graph_calls is not None:
                owner._graph_calls.append((graph, args, outputs))

        dynamo_backend = PiecewiseDynamoBackend(self.compiler, make_piece, on_compiled, on_graph_call)
        self._compiled = torch.compile(entry, backend=dynamo_backend, fullgraph=True)

    def uninstall(self) -> None:
        """Drop the graphs and stop using the model; its original forward comes back when
        no other tc_piecewise backend uses it."""
        self.cleanup()
        if self._forward_wrapper is not None:
            self._forward_wrapper.remove()
        self._forward_wrapper = self._model = self._compiled = self._plan = None

    def _is_active(self) -> bool:
        act = current_activity()
        return act is not None and act.owner is self

    def _make_piece(self, split: SplitGraph, item: SplitItem, compiled: Any) -> GraphPiece:
        return GraphPiece(
            self, compiled, name=item.name, description=split.describe(item), is_first=item.piece_index == 0
        )

    def _on_compiled(self, graph: CompiledGraph) -> None:
        self.compiled_graphs.append(graph)
        act = current_activity()
        if act is not None and act.mode is Mode.REPLAY:
            # A guard failed while serving (sglang: "dynamo recompiled at serving time"):
            # the new pieces have no graphs, so this shape runs compiled but uncaptured.
            warnings.warn(
                f"tc_piecewise: torch.compile recompiled the {self.phase} forward during replay of {act.key} "
                "(a Dynamo guard failed); it runs without CUDA graphs. Set TORCH_LOGS=recompiles to see why.",
                RuntimeWarning,
                stacklevel=2,
            )

    # -- the compiled forward ------------------------------------------------------------
    def _run(self, *args: Any, **kwargs: Any) -> Any:
        """The compiled forward (the model's forward while this backend has an activity)."""
        act = current_activity()
        if act is not None and act.mode is Mode.REPLAY:
            direct = self._direct.get(act.key)  # type: ignore[arg-type]
            if direct is not None and direct.signature == _batch_signature(args, kwargs):
                with torch.no_grad():
                    return direct.run()
        else:
            mark_dynamic_tokens(args, kwargs)
        # Dynamo traced the runner's StaticForwardBatch; a plain ForwardBatch (eager
        # fallback, forward_compiled) would fail its type guard and recompile the model.
        args = tuple(as_static_batch(a) if type(a) is ForwardBatch else a for a in args)
        record = (
            act is not None
            and act.mode is Mode.CAPTURE
            and self.direct_replay
            and self.capture_enabled
            and self._graph_calls is None
        )
        if record:
            self._graph_calls = []
        try:
            with torch.no_grad():
                try:
                    result = self._compiled(*args, **kwargs)  # type: ignore[misc]
                except torch._dynamo.exc.TorchDynamoException as exc:
                    raise self._compile_error(exc) from exc
            if record:
                self._record_direct(act.key, args, kwargs, result, self._graph_calls)  # type: ignore[union-attr,arg-type]
            return result
        finally:
            if record:
                self._graph_calls = None

    def _record_direct(
        self,
        key: Optional[ShapeKey],
        args: tuple,
        kwargs: Dict[str, Any],
        result: Any,
        calls: List[Tuple[CompiledGraph, tuple, Any]],
    ) -> None:
        """Keep what a replay of ``key`` needs to call the split module without Dynamo."""
        if key is None:
            return
        direct: Optional[_DirectReplay] = None
        if key not in self._direct and len(calls) == 1:  # a second forward per capture: no direct replay
            graph, graph_args, outputs = calls[0]
            try:
                direct = _DirectReplay(
                    graph.forward,  # type: ignore[arg-type]  # set: the graph ran in this capture
                    graph_args,
                    _output_spec(result, outputs),
                    _batch_signature(args, kwargs),
                )
            except _NotDirect as exc:
                logger.info("tc_piecewise (%s): %s replays through Dynamo: %s", self.phase, key, exc)
        self._direct[key] = direct

    def _compile_error(self, exc: BaseException) -> BaseException:
        """Our own piece-compile error, or the core's host-value guard error, unwrapped from
        Dynamo's; else a trace failure."""
        for e in exception_chain(exc):
            if isinstance(e, TcPiecewiseCompileError):
                return TcPiecewiseCompileError(str(e))
            if isinstance(e, CudaGraphHostValueError):  # a copy: the original is in exc's chain
                return CudaGraphHostValueError(str(e), field=e.field, backend=e.backend, phase=e.phase)
        from cuda_graph_runner.backend import registered_eager_ops

        model = type(self._model).__name__
        marked = ", ".join(sorted(op.qualname for op in registered_eager_ops().values())) or "none registered"
        text = str(exc).strip()
        lines = text.splitlines()
        detail = "\n".join(lines[:25]) + ("\n..." if len(lines) > 25 else "")
        return TcPiecewiseCompileError(
            f"tc_piecewise: torch.compile could not turn {model}.forward into one graph to split at the marked ops "
            f"({marked}); the model code must be traceable by Dynamo with fullgraph=True (mark eager-only code "
            f"with cuda_graph_runner.backend.graph_break.eager_op). Dynamo says: {type(exc).__name__}: {detail}"
        )

    def verify_tolerance(self, dtype: torch.dtype) -> Tuple[float, float]:
        """Verify mode compares with eager (the base reference). ``eager`` pieces run the same
        ops as eager: the base tolerance. ``inductor`` fuses and reorders reductions: ten
        times the base tolerance (float32: atol 1e-3, rtol 1e-2; bfloat16: 0.5)."""
        if self.compiler == "inductor":
            return compiled_verify_tolerance(dtype)
        return super().verify_tolerance(dtype)

    def forward_compiled(self, batch: ForwardBatch, key: Optional[ShapeKey] = None) -> Any:
        """``model.forward(batch)`` through the compiled pieces, outside the runner.

        Pieces replay their graphs when ``key`` was captured and ``batch`` is its static
        batch; otherwise (any other size) they run compiled without graphs.

        Raises:
            RuntimeError: ``prepare`` was not called.
        """
        self._require_prepared()
        with forward_context(batch), activity(self, Mode.REPLAY, key if key in self.graph_table else None):
            return self._run(batch)

    # -- the contract (sessions and can_run: the base class's; pieces capture on
    # ``self.capture_stream``, which its capture_session binds) ---------------------------
    def _synchronize(self) -> None:
        if self.device.type != "cpu" or self._device_module is not None:
            self.synchronize()  # names self.device, whatever device is current

    def _require_prepared(self) -> None:
        if self._plan is None or self._compiled is None:
            raise RuntimeError("tc_piecewise: call prepare(plan) first (the runner's capture() does)")

    def capture_one(self, key: ShapeKey, forward_fn: ForwardFn, *, post_warmup_hook: WarmupHook = None) -> None:
        """Warm up every piece for ``key`` (call 1), then capture each (call 2).

        Raises:
            RuntimeError: ``prepare`` was not called.
            TcPiecewiseRuntimeError: a piece failed (names the piece and the op).
        """
        self._require_prepared()
        self.graph_table.check_new(key)

        def warmup_fn() -> Any:
            with activity(self, Mode.WARMUP, key):
                return forward_fn()

        # The base loop; the ``auto`` policy skips sizes the compile pass ran (prepare).
        self.warm_up(warmup_fn, post_warmup_hook, key=key)
        self._direct.pop(key, None)
        with self.on_capture_stream(), activity(self, Mode.CAPTURE, key):
            forward_fn()
        self._synchronize()
        self.graph_table.add(key, None)  # the graphs live in the pieces

    def replay(self, key: ShapeKey, static_batch: ForwardBatch) -> Any:
        """Run ``plan.forward(static_batch)`` (the contract's replay forward) with every
        piece replaying its graph.

        Args:
            key: a captured key.
            static_batch: the runner's static batch for ``key`` (token-axis tensors
                ``[key.size * width]`` int64 views of its buffers, filled with the live batch).

        Returns:
            What ``plan.forward`` returns: decode, float32 logits ``[tokens, vocab]``
            (the LM head runs eagerly on the last piece's output); prefill, the hidden states
            ``[tokens, hidden]`` in the model dtype, which alias graph-pool memory until the
            next replay of any graph in the pool.

        Raises:
            KeyError: ``key`` was not captured.
        """
        self.graph_table.get(key)  # KeyError naming the captured keys
        with activity(self, Mode.REPLAY, key):
            return self._plan.forward(static_batch)  # type: ignore[union-attr]

    def cleanup(self) -> None:
        """Drop every piece's graphs and outputs; compiled pieces (and Dynamo's cache) stay,
        so ``prepare`` + capture again costs no compilation."""
        for graph in self.compiled_graphs:
            for piece in graph.pieces:
                piece.reset()
        self.graph_table.clear()
        self._direct.clear()

    def discard(self, key: ShapeKey) -> None:
        """Drop ``key``'s graph in every piece (those a failed capture made too)."""
        for graph in self.compiled_graphs:
            for piece in graph.pieces:
                piece.discard(key)
        self.graph_table.discard(key)
        self._direct.pop(key, None)

    def describe_graph(self, key: ShapeKey) -> Dict[str, Any]:
        """``{"pieces", "piece_names", "nodes", "kernels"}`` of ``key``: how many compiled
        pieces hold a graph of ``key`` (the marked ops run eagerly between them), their
        names, and node/kernel counts summed over those graphs (None where torch cannot
        tell: :mod:`cuda_graph_runner.backend.graph_nodes`); ``{}`` for a key not captured."""
        if key not in self.graph_table:
            return {}
        from cuda_graph_runner.backend import graph_node_counts

        held = [p for g in self.compiled_graphs for p in g.pieces if key in p.entries]
        counts = [graph_node_counts(p.entries[key].graph) for p in held]
        known = bool(counts) and all(c is not None for c in counts)
        return {
            "pieces": len(held),
            "piece_names": [p.name for p in held],
            "nodes": sum(c["nodes"] for c in counts if c) if known else None,
            "kernels": sum(c["kernels"] for c in counts if c) if known else None,
        }

    def piece_calls(self) -> Dict[str, int]:
        """Calls per mode summed over the pieces of every compiled graph (for tests and logs)."""
        total: Dict[str, int] = {}
        for graph in self.compiled_graphs:
            for piece in graph.pieces:
                for mode, n in piece.calls.items():
                    total[mode] = total.get(mode, 0) + n
        return total


__all__ = [
    "TcPiecewiseCudaGraphBackend",
    "mark_dynamic_tokens",
    "Activity",
]
