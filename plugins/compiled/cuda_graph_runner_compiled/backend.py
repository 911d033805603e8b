"""``CompiledBackend``: the model's forward compiled with torch.compile per size bucket.

sglang's CPU graph runner (``python/sglang/srt/model_executor/cpu_graph_runner.py``)
as a backend of our runners: on a device without graphs the cost of a decode step of a
small model is Python and op-dispatch overhead, which inductor removes by compiling the
forward into fused C++ loops, one specialization per batch-size bucket. The runner pads
each live batch to its bucket (``capture_sizes``) exactly as it does for graphs, so a
replay runs the code compiled for that bucket on the runner's static buffers.

How it runs:

``prepare(plan)``
    Remembers the capture plan's model, its forward as written
    (:func:`~cuda_graph_runner.backend.model_forward.forward_as_written`: never another
    backend's dispatcher) and the plan's ``forward`` (the runner's public "what one graph
    records" method).
``capture_one(key, forward_fn)``
    Makes ``torch.compile(forward, dynamic=False, fullgraph=True)`` for ``key`` (a code
    object of its own per key, so Dynamo keeps one cache entry per bucket and never hits
    its recompile limit) with no guards (:func:`_no_guards`), then calls ``forward_fn``
    with that compiled forward put in place of ``model.forward``: the first call
    compiles, the next runs warm the compiled code up. Marked ops (attention) are torch
    custom ops: Dynamo and inductor keep them opaque, and they run on the live batch's
    metadata at every call.
``replay(key, static_batch)``
    ``plan.forward(static_batch)`` with ``key``'s compiled forward in place of
    ``model.forward`` (only for the call and only in the calling thread:
    :func:`~cuda_graph_runner.backend.model_forward.forward_replaced`; the runner's eager
    fallback, any other backend on the model and other threads see the forward as
    written) and with dispatch below the autograd and ADInplaceOrView keys
    (:func:`_below_autograd`). The output is fresh tensors per call, which the contract
    allows. Nothing of it is process-wide: replays from several threads, and compiled
    code the model's marked ops call themselves, run as they would alone.

Compile time is bounded: once this backend has compiled for ``compile_budget_s`` seconds
the sizes still to capture are left uncompiled (a warning names them); the runner runs
them eagerly (``can_run`` is False), or pads them to a compiled bucket when the caller
captures only the compiled sizes.

What pays on the CPU (``tiny`` preset, float32, batch 1, one thread, 2-core machine;
eager / compiled per step, the median of 9 interleaved rounds,
:func:`cuda_graph_runner.cli.bench.measure.paired_ms`):

* ``cpp_wrapper`` (kept, :data:`DEFAULT_INDUCTOR_OPTIONS`): the compiled graph's host
  code in C++ (numbers there).
* no guards on the per-bucket entry (kept, :func:`_no_guards`): evaluating them made a
  step 1.14x / 1.06x slower at batch 1 / 4 (paired rounds, inductor, on a loaded machine).
* dispatch below autograd in ``replay`` (kept): 0.86 -> 0.66 ms per step, 1.6x -> 2.0x
  over eager; see :func:`_below_autograd`. ``torch.inference_mode()`` instead saves less
  (0.80 ms) and makes the outputs inference tensors a caller cannot write into.
* ``freezing`` (sglang's CPU runner sets it; not kept): weights folded as constants and
  prepacked; 1.58x / 1.56x against 1.63x / 1.54x without, in the same session, while the
  compile took up to 3x longer: a small model's linears gain nothing from prepacking.
* ``dynamic=False`` per bucket (kept): one static specialization per size, what
  sglang's CPU runner compiles too; a dynamic compile would pay symbolic-shape guards.
* Threads: with more intra-op threads than the CPUs other processes leave free, every
  OpenMP region waits for a descheduled thread (5-50x per step, eager alike); one thread
  suits a small model on a shared CPU (the bench runs half the CPUs,
  :mod:`cuda_graph_runner.cli.bench.cpu_threads`). The generated kernels read the thread count at
  run time (the compile cache scope sets ``cpp.dynamic_threads``), so one cache entry
  serves every count.
* Where it does not pay: a model whose decode step is its matmuls (SmolLM2-135M, 30
  layers of width 576: 0.8-1.2x eager for 156 s of compiling three sizes); the bench
  runs it there only when asked.

Compilers (``compiler=``): ``"inductor"`` (the default and the point: fused C++ kernels,
needs a C++ toolchain, see :mod:`.toolchain`), ``"aot_eager"`` and ``"eager"`` (cheap,
for tests: the same Dynamo trace without code generation), or a callable Dynamo backend.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Union

import torch

from cuda_graph_runner.backend import (
    BaseCudaGraphBackend,
    CapturePlan,
    ForwardBatch,
    ForwardFn,
    ShapeKey,
    WarmupHook,
    compile_cache_scope,
    entry_function,
    envs,
    forward_as_written,
    forward_replaced,
)

from . import plugin

logger = logging.getLogger(__name__)

#: Compiler names accepted by ``compiler=`` (a callable Dynamo backend is accepted too).
COMPILERS = ("inductor", "aot_eager", "eager")

#: Default bound on the seconds one backend spends compiling (all its sizes together).
DEFAULT_COMPILE_BUDGET_S = 600.0

#: Inductor options that pay on the CPU: ``cpp_wrapper`` makes the compiled graph's
#: host code C++ (one call instead of a Python line per kernel), which is most of what a
#: small decode step costs; measured on the ``tiny`` preset at batch 1 (one thread):
#: 1.6x over eager without it, 3.7x with it, for the same compile time.
DEFAULT_INDUCTOR_OPTIONS: Dict[str, Any] = {"cpp_wrapper": True}


class CompiledBackend(BaseCudaGraphBackend):
    """The forward compiled per captured size with ``torch.compile``; no device graph.

    Args (beyond ``BaseCudaGraphBackend``'s):
        compiler: ``"inductor"``, ``"aot_eager"``, ``"eager"`` or a callable Dynamo backend
            (``backend(gm, example_inputs) -> callable``); None reads
            ``CUDA_GRAPH_RUNNER_COMPILED_COMPILER`` (default ``inductor``).
        compile_budget_s: seconds of compilation after which the remaining sizes are not
            compiled; None reads ``CUDA_GRAPH_RUNNER_COMPILED_BUDGET_S``, else
            :data:`DEFAULT_COMPILE_BUDGET_S`; ``float("inf")``: unbounded.
            A size already being compiled finishes, so the total can exceed the budget
            by one size's compile time.
        inductor_options: inductor config patches (``torch.compile(options=...)``) for
            ``"inductor"``; None means :data:`DEFAULT_INDUCTOR_OPTIONS`.
        cache: compile inside :func:`cuda_graph_runner.backend.compile_cache.compile_cache_scope`
            (inductor's and AOTAutograd's caches under this project's cache root, so a
            second process compiles from them; Dynamo still traces, see ``capture_one``);
            False leaves torch's settings alone.

    Raises:
        ValueError: unknown ``compiler``, or a negative ``compile_budget_s``.

    Attributes:
        compile_seconds: seconds spent in the first (compiling) call of every size so far.
        skipped_keys: keys left uncompiled because the budget was spent.
    """

    # Only what Dynamo traces is frozen into the compiled code; a host read there would
    # become a guard (a recompile per value), so it is an error while tracing.
    host_value_guard = "trace"
    # The compiling call is the first run; one more runs the compiled code warm (its
    # allocations made).
    num_warmups = 1

    def __init__(
        self,
        *args: Any,
        compiler: Union[str, Callable[..., Any], None] = None,
        compile_budget_s: Optional[float] = None,
        inductor_options: Optional[Dict[str, Any]] = None,
        cache: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if compiler is None:
            compiler = envs.get(plugin.COMPILER) or "inductor"
        if not callable(compiler) and compiler not in COMPILERS:
            raise ValueError(f"backend 'compiled': unknown compiler {compiler!r}; accepted: {', '.join(COMPILERS)}")
        if compile_budget_s is None:
            compile_budget_s = envs.get(plugin.BUDGET_S)
        budget = DEFAULT_COMPILE_BUDGET_S if compile_budget_s is None else float(compile_budget_s)
        if budget < 0:
            raise ValueError(f"backend 'compiled': compile_budget_s={compile_budget_s!r} must be >= 0 (seconds)")
        self.compiler = compiler
        self.compile_budget_s = budget
        self.inductor_options = dict(DEFAULT_INDUCTOR_OPTIONS if inductor_options is None else inductor_options)
        self.cache = cache
        self.compile_seconds: float = 0.0
        self.skipped_keys: List[ShapeKey] = []
        self._compiled: Dict[ShapeKey, Callable[..., Any]] = {}
        self._model: Any = None
        self._graph_forward: Optional[Callable[[ForwardBatch], Any]] = None
        self._original_forward: Optional[Callable[..., Any]] = None

    # -- set-up ---------------------------------------------------------------------
    def prepare(self, plan: CapturePlan) -> None:
        """Remember the plan's model, its forward as written (beneath any other backend's
        dispatcher), and the plan's forward."""
        self._model = plan.model
        self._graph_forward = plan.forward
        self._original_forward = forward_as_written(plan.model)

    def _compile(self, key: ShapeKey) -> Callable[..., Any]:
        if self._original_forward is None:
            raise RuntimeError("backend 'compiled': call prepare(plan) first (the runner's capture() does)")
        entry = entry_function(self._original_forward, f"compiled_forward_{key.variant or 'v'}_{key.size}")
        options: Dict[str, Any] = dict(self.inductor_options) if self.compiler == "inductor" else {}
        options["guard_filter_fn"] = _no_guards  # torch pops it from the dict it is given
        return torch.compile(entry, backend=self.compiler, dynamic=False, fullgraph=True, options=options)

    # -- the contract -----------------------------------------------------------------
    def capture_one(self, key: ShapeKey, forward_fn: ForwardFn, *, post_warmup_hook: WarmupHook = None) -> None:
        """Compile the forward for ``key`` (first call of ``forward_fn``), then warm it up.

        Raises:
            ValueError: ``key`` was already captured (``cleanup()`` first).
            RuntimeError: ``prepare`` was not called (the runner calls it).
        """
        if key in self._compiled:
            raise ValueError(f"shape {key} is already compiled; call cleanup() before capturing it again")
        if self._model is None:
            raise RuntimeError("backend 'compiled': prepare(runner) must run before capture_one")
        if self.compile_seconds >= self.compile_budget_s:
            self.skipped_keys.append(key)
            logger.warning(
                "backend 'compiled': compile budget of %.0f s spent (%.1f s so far); size %d stays uncompiled "
                "and runs eagerly (raise compile_budget_s, or capture fewer sizes)",
                self.compile_budget_s,
                self.compile_seconds,
                key.size,
            )
            return
        # The inductor caches only (no compile key): Dynamo's traced code loaded from the
        # cache brings the guards it was saved with (its dispatch-state guard among them),
        # so a loaded entry would refuse every replay below autograd (_below_autograd).
        compiled = self._compile(key)
        scope = compile_cache_scope() if self.cache else contextlib.nullcontext()
        with forward_replaced(self._model, compiled):
            start = time.perf_counter()
            with scope:
                forward_fn()  # compiles
            self.compile_seconds += time.perf_counter() - start
            self.note_kernels_ran(key)
            for _ in range(self.warmup_runs(key)):
                forward_fn()
        if post_warmup_hook is not None:
            post_warmup_hook()
        self._compiled[key] = compiled

    def can_run(self, batch: ForwardBatch, key: ShapeKey) -> bool:
        return key in self._compiled

    def replay(self, key: ShapeKey, static_batch: ForwardBatch) -> Any:
        compiled = self._compiled.get(key)
        if compiled is None:
            raise KeyError(f"no compiled forward for {key}; compiled: {sorted(self._compiled)}")
        assert self._graph_forward is not None
        with forward_replaced(self._model, compiled), _below_autograd():
            return self._graph_forward(static_batch)

    def cleanup(self) -> None:
        self._compiled.clear()
        self.skipped_keys.clear()

    def discard(self, key: ShapeKey) -> None:
        self._compiled.pop(key, None)
        if key in self.skipped_keys:
            self.skipped_keys.remove(key)

    @property
    def captured_keys(self) -> list:
        """Compiled keys, in capture order."""
        return list(self._compiled)

    def verify_tolerance(self, dtype: torch.dtype) -> "tuple[float, float]":
        """Inductor reorders and fuses reductions: float32 sums differ from eager by more
        than the base's near-exact float32 bound; other dtypes keep the base's."""
        if dtype == torch.float32:
            return (1e-3, 1e-3)
        return super().verify_tolerance(dtype)


def _no_guards(guards: Sequence[Any]) -> List[bool]:
    """Dynamo guard filter (``torch.compile(options={"guard_filter_fn": ...})``) that
    keeps none of a per-bucket entry's guards: PyTorch's ``skip_all_guards_unsafe``.

    Why it is safe here: each bucket's code object holds exactly one compiled entry and
    only this backend calls it, always on the same static buffers (the shapes the entry
    was made for), as a graph replay runs no Python at all; and the replay dispatches
    below autograd (:func:`_below_autograd`), which a dispatch-key guard would refuse.
    Unlike ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` (process-wide:
    every thread's compiled code, a marked op's own compiled helpers among it, would skip
    its guards or fail to compile while a replay runs) it belongs to this entry alone.
    """
    return [False] * len(guards)


def _below_autograd() -> ContextManager[Any]:
    """Dispatch below the Autograd and ADInplaceOrView keys while grad is off (the runner
    replays under no_grad); with grad on, or without the (private) guard, nothing changes.

    Why: every op the compiled code calls back into (the opaque custom ops: attention,
    and its own ops run eagerly) still passes those keys under no_grad, and for a
    ``torch.library`` custom op they are two Python layers per call
    (torch/_library/autograd.py, custom_ops.py); below them a ``tiny`` decode step at
    batch 1 costs ~25% less host time. It is PyTorch's AutoDispatchBelowADInplaceOrView,
    what InferenceMode does, without making the outputs inference tensors (callers may
    write into them). In-place writes (the KV cache) run but bump no version
    counter, exactly as a CUDA graph replay's kernels do: a tensor saved for backward by
    an earlier grad-enabled forward and then overwritten is not detected, with any
    graph backend.
    """
    if _DISPATCH_BELOW_AUTOGRAD is None or torch.is_grad_enabled():
        return contextlib.nullcontext()
    return _DISPATCH_BELOW_AUTOGRAD()


#: PyTorch's AutoDispatchBelowADInplaceOrView guard (private; None where torch lacks it).
_DISPATCH_BELOW_AUTOGRAD = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", None)
