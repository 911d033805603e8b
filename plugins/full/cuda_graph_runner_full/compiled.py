"""Compiled full: the model's forward compiled with inductor, then captured whole per size.

``torch_compile: inductor`` (or ``true``) on backend ``full``: sglang's
``--enable-torch-compile``; the default, ``false``, leaves the forward as written. Sizes up
to ``torch_compile_max_bs`` (sglang's ``--torch-compile-max-bs``, default 32) are captured
from the compiled forward, larger ones from the forward as written, as in sglang.
sglang's torch.compile + CUDA graph path and
vLLM's FULL cudagraph mode with compilation: inductor fuses each layer's norms, RoPE and
activation into a few Triton kernels, and the CUDA graph then removes the launch
overhead of what is left, so a decode step beats ``torch.compile(mode="reduce-overhead")``
(which graphs the same code, but through CUDA-graph trees and their per-call checks).

How it runs (:class:`CompiledForward`):

``prepare(plan)``
    ``torch.compile(model.forward, backend=inductor, fullgraph=True)`` (the forward as
    written, never another backend's dispatcher) with a code object of its own (a
    compile size's: ``fullgraph=False``, so the op bodies' own compiles run inside it; a
    forward that splits into several graphs is refused all the same),
    and the *compile pass*: one forward per planned key, largest first, on
    ``plan.static_batch(key)``, with dim 0 of the batch's tensors marked dynamic.
    The first call (largest size) compiles one graph that serves every size >= 2 (the
    token axis symbolic); size 1, which Dynamo always specializes, costs one more
    compile. Nothing recompiles per captured size. Each size of ``compile_sizes``
    (vLLM's option of that name) instead gets a graph compiled with static shapes, from
    a code object of its own (``dynamic=False``): inductor specializes its kernels' launch
    configs and masks to the size, as ``torch.compile(mode="reduce-overhead")`` does
    for every size it sees (H200, llama-3.2-1b: 1-2% faster than the dynamic graph at
    batch 32, the same kernels as reduce-overhead; a few seconds of compile per size).
    At a compile size the *bodies* of the marked ops get compiled too (next section).
    The pass runs inside
    :func:`cuda_graph_runner.backend.compile_cache.compile_cache_scope`, so a second process
    compiles from the disk cache.
``capture_one`` / verify
    While ``full`` warms up and records a size, and while verify mode computes its
    reference, the size's compiled forward (static, else the dynamic one) stands in for
    ``model.forward`` in that thread (``model_forward.forward_replaced``): the graph
    records inductor's kernels with the marked ops (attention) as opaque custom ops in
    between.
    A replay runs no Python at all.

Marked op bodies (regional compilation)
    At each compile size the marked ops (attention) run bodies compiled with the same
    compiler: the op stays opaque to the forward's graph, while what runs inside it
    fuses (:mod:`.op_bodies`). Dynamic sizes and verify's reference run the bodies as
    written.

Marked ops must be capture-safe for the phase, exactly as for plain ``full``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from typing import Any, Callable, Dict, Iterator, Optional, Sequence

import torch

from cuda_graph_runner.backend import (
    CudaGraphConfigError,
    cache_counters,
    compile_cache_scope,
    compile_key,
    entry_function,
    forward_as_written,
    forward_context,
    forward_replaced,
    marked_op_bodies,
    progress,
)

from .op_bodies import compiled_op_bodies

logger = logging.getLogger(__name__)

#: Values of ``torch_compile`` that make ``full`` compile.
COMPILING = ("inductor",)

#: Inductor options for a graph-captured decode step: no CUDA-graph trees (``full``
#: captures the whole forward itself), otherwise inductor's defaults. Measured on an H200
#: (llama-3.2-1b, bf16, batch 1/32/128, ratios in one process: CHANGELOG.md and
#: benchmarks/results/2026-12-01-h200-compiled-full-options/),
#: neither tuning option paid inside a captured graph: coordinate-descent tuning
#: 0.6-1.4% slower per step for 60 s more compile, ``max_autotune_gemm`` (Triton GEMM
#: templates picked by micro-benchmark) 3-18% slower for 160 s more. Pass them through
#: ``inductor_options`` to try them on another model or GPU.
DEFAULT_INDUCTOR_OPTIONS: Dict[str, Any] = {"triton.cudagraphs": False}


class CompiledForward:
    """One model's forward compiled with inductor, put in place while ``full`` runs it.

    Args:
        compiler: ``"inductor"`` or a callable Dynamo backend (tests: a counting one).
        tag: names the compiled code object (Dynamo keeps its cache per code object, so
            two backends on one model never evict each other's entries).
        inductor_options: inductor config patches; None means
            :data:`DEFAULT_INDUCTOR_OPTIONS` (``triton.cudagraphs`` is always off).
        static_sizes: sizes (batch sizes or token counts) compiled with static shapes,
            each its own Dynamo graph (config ``compile_sizes``); every one must be a
            captured size (checked by :meth:`compile_pass`).
        max_size: the largest size run compiled (config ``torch_compile_max_bs``); larger
            sizes run the forward as written. None: every size.

    Attributes:
        compile_seconds: duration of the last compile pass (None before one).
        dynamo_graphs: graphs of the forward Dynamo handed the compiler so far: 1 for
            the dynamic sizes >= 2, 1 for size 1 when captured, 1 per static size; more
            means a recompile; 0 when the compile cache had Dynamo's code
            (:mod:`cuda_graph_runner.backend.compile_cache_dynamo`).
        op_body_graphs: graphs of marked-op bodies compiled so far (compile sizes only;
            a body may take a few per size: it graph-breaks where it reads the forward
            context, and its first layer's call computes the step's metadata).
        op_body_graphs_by_size: per compile size, the body graphs its compile pass made
            (not always equal: the H200 made ``{16: 2, 4: 1}`` for the reference model on
            torch 2.11, torch 2.13 on the CPU 3 per size; logged when unequal).
        loaded: whether the dynamic-shape forward's Dynamo code came from the compile
            cache at the last :meth:`bind`.

    Raises:
        ValueError: ``compiler`` does not compile; a static size is not a positive int.
    """

    def __init__(
        self,
        compiler: Any = "inductor",
        *,
        tag: str = "",
        inductor_options: Optional[dict] = None,
        static_sizes: Sequence[int] = (),
        max_size: Optional[int] = None,
    ) -> None:
        if not callable(compiler) and compiler not in COMPILING:
            raise ValueError(f"full: torch_compile {compiler!r} does not compile; compiling values: {COMPILING}")
        for size in static_sizes:
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"full: compile size {size!r} is not a positive int")
        self.compiler = compiler
        self.tag = tag
        self.static_sizes = tuple(sorted(set(static_sizes)))
        self.max_size = max_size
        options = dict(DEFAULT_INDUCTOR_OPTIONS if inductor_options is None else inductor_options)
        options["triton.cudagraphs"] = False
        self.inductor_options = options
        self.compile_seconds: Optional[float] = None
        self.dynamo_graphs = 0
        self.op_body_graphs = 0
        self.op_body_graphs_by_size: Dict[int, int] = {}
        self._model: Any = None
        self._compiled: Optional[Callable[..., Any]] = None
        self._static: Dict[int, Callable[..., Any]] = {}
        self._op_bodies: Dict[int, Dict[str, Callable[..., Any]]] = {}
        self.loaded = False

    def _dynamo_backend(self, counter: str = "dynamo_graphs") -> Callable[..., Any]:
        inner: Callable[..., Any]
        if callable(self.compiler):
            inner = self.compiler
        else:
            from torch._inductor.compile_fx import compile_fx

            inner = functools.partial(compile_fx, config_patches=self.inductor_options)

        def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            setattr(self, counter, getattr(self, counter) + 1)
            return inner(gm, example_inputs)

        return backend

    def bind(self, model: Any, *, label: str = "full", phase: str = "decode", guard_scope: str = "forward") -> None:
        """Compile ``model.forward`` lazily (first call); idempotent for the same model.
        ``label``, ``phase`` and ``guard_scope`` (the runner's host-value guard scope) go
        to the marked-op bodies (:func:`.op_bodies.compiled_op_bodies`).

        Raises:
            RuntimeError: bound to another model already; or inductor on CUDA without Triton.
        """
        if self._model is model:
            return
        if self._model is not None:
            raise RuntimeError("full: this compiled forward is bound to another model; build a new backend")
        device = next((p.device for p in model.parameters()), None) if hasattr(model, "parameters") else None
        if self.compiler == "inductor" and device is not None and device.type == "cuda":
            from torch.utils._triton import has_triton

            if not has_triton():
                raise RuntimeError("full: torch_compile 'inductor' on CUDA needs Triton (pip install triton)")
        self._model = model
        backend = self._dynamo_backend()
        # The forward as written: model.forward may be another backend's dispatcher.
        forward = forward_as_written(model)
        entry = entry_function(forward, f"full_compiled_forward_full_{self.tag}")
        hits = cache_counters()["dynamo_hit"]
        self._compiled = torch.compile(entry, backend=backend, fullgraph=True)  # loads cached Dynamo code, if any
        self.loaded = cache_counters()["dynamo_hit"] > hits
        # A code object per static size: Dynamo's cache (and automatic dynamic shapes) is
        # per code object, so each sees one size only and stays static. Not fullgraph:
        # code compiled with fullgraph=True runs nested frames without Dynamo, which would
        # leave the marked ops' compiled bodies uncompiled; compile_pass refuses a forward
        # that split into several graphs instead (a break with nothing on one side makes
        # one graph and runs no Python between graphs; torch's error_on_graph_break would
        # wrap every size's entry in one shared code object, and so one recompile limit).
        self._static = {
            size: torch.compile(
                entry_function(forward, f"full_compiled_forward_full_{self.tag}_static_{size}"),
                backend=backend,
                fullgraph=False,
                dynamic=False,
            )
            for size in self.static_sizes
        }
        self._op_bodies = compiled_op_bodies(
            self.static_sizes,
            tag=self.tag,
            phase=phase,
            backend=self._dynamo_backend("op_body_graphs"),
            label=label,
            guard_scope=guard_scope,
        )

    def compiles(self, size: int) -> bool:
        """Whether ``size`` runs compiled (at most :attr:`max_size`)."""
        return self.max_size is None or size <= self.max_size

    @contextlib.contextmanager
    def active(self, size: Optional[int] = None) -> Iterator[None]:
        """``model.forward`` is the compiled forward for the block, then what it was:
        ``size``'s static graph when ``size`` is a static size, else the dynamic one;
        at a static size the marked ops run their compiled bodies too. A size above
        :attr:`max_size` keeps the forward as written."""
        if self._model is None or self._compiled is None or (size is not None and not self.compiles(size)):
            yield
            return
        with contextlib.ExitStack() as stack:
            if size is not None and size in self._static:  # the op bodies exist at exactly these sizes
                stack.enter_context(forward_replaced(self._model, self._static[size]))
                stack.enter_context(marked_op_bodies(self._op_bodies[size]))
            else:
                stack.enter_context(forward_replaced(self._model, self._compiled))
            yield

    def check_sizes(self, plan: Any) -> None:
        """Every static size is one of ``plan``'s captured sizes (a size never captured
        would only cost a compile: its graph would never run).

        Raises:
            CudaGraphConfigError: names the size, the key ``compile_sizes`` and the captured sizes.
        """
        captured = sorted({key.size for key in plan.keys})
        missing = [size for size in self.static_sizes if size not in captured]
        if missing:
            raise CudaGraphConfigError(
                f"size(s) {missing} not captured, so never replayed",
                phase=plan.phase,
                key="compile_sizes",
                value=list(self.static_sizes),
                accepted=f"sizes among the captured sizes {captured}",
            )

    def compile_pass(self, plan: Any, *, label: str = "full") -> float:
        """Bind ``plan.model`` and run one compiled forward per planned key (largest
        first) on the plan's capture batches; returns and records the seconds.

        Args:
            plan: the runner's :class:`~cuda_graph_runner.backend.capture_plan.CapturePlan`.

        Raises:
            CudaGraphConfigError: a static size is not among the plan's sizes (before
                anything compiles).
            RuntimeError: the forward at a compile size broke into several graphs.
            CudaGraphHostValueError: a marked op's body read a host value at a compile size.
            whatever Dynamo or inductor raise (a graph break, a failed lowering), unchanged.
        """
        start = time.perf_counter()
        self.check_sizes(plan)
        keys = [key for key in plan.keys if self.compiles(key.size)]
        with contextlib.ExitStack() as scope:
            if not callable(self.compiler):  # bind (torch.compile) inside: it loads Dynamo's cached code
                options = [*sorted(self.inductor_options.items()), ("static_sizes", self.static_sizes)]
                scope.enter_context(compile_cache_scope(compile_key(plan.model, "full", self.tag, options)))
            self.bind(plan.model, label=label, phase=plan.phase, guard_scope=plan.host_value_guard)
            for key in progress.bar(
                keys,
                desc=f"compile {plan.phase} (full, inductor)",
                done=f"compiled {plan.phase} for {len(keys)} shapes (full, inductor)",
                show=getattr(plan, "show_progress", None),
            ):
                batch = plan.static_batch(key)  # init_forward_metadata_capture already called
                if key.size not in self._static and not self.loaded:
                    # Loaded code's guards take the batch unmarked (torch 2.13 saves no marks).
                    mark_dynamic_tokens(batch)
                graphs, body_graphs = self.dynamo_graphs, self.op_body_graphs
                with self.active(key.size), forward_context(batch):
                    plan.forward(batch)
                if key.size in self._op_bodies:
                    self.op_body_graphs_by_size[key.size] = self.op_body_graphs - body_graphs
                if key.size in self._static and self.dynamo_graphs - graphs > 1:
                    raise RuntimeError(
                        f"full: the forward at compile size {key.size} broke into {self.dynamo_graphs - graphs} "
                        "graphs; compiled full records one graph per size (TORCH_LOGS=graph_breaks shows where)"
                    )
        self.compile_seconds = time.perf_counter() - start
        if len(set(self.op_body_graphs_by_size.values())) > 1:
            logger.info("full: marked-op body graphs per compile size: %s", self.op_body_graphs_by_size)
        logger.info(
            "full: forward compiled (%s) for %d shapes in %.2f s, %d Dynamo graph(s), %d of marked-op bodies",
            self.compiler if isinstance(self.compiler, str) else "custom",
            len(keys),
            self.compile_seconds,
            self.dynamo_graphs,
            self.op_body_graphs,
        )
        return self.compile_seconds


def mark_dynamic_tokens(batch: Any) -> None:
    """Mark dim 0 of every tensor field of ``batch`` (a dataclass) dynamic where it has at
    least 2 rows (Dynamo always specializes sizes 0 and 1)."""
    for field in dataclasses.fields(batch):
        value = batch.__dict__.get(field.name)
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] >= 2:
            torch._dynamo.mark_dynamic(value, 0)
