"""The torch.compile backend: split the Dynamo graph at the marked ops, compile each piece.

``PiecewiseDynamoBackend(gm, example_inputs)`` is what ``torch.compile(...,
backend=...)`` calls with the one FX graph Dynamo traced (vLLM ``VllmBackend`` +
``PiecewiseCompileInterpreter``, sglang ``SGLangBackend``):

1. :func:`~cuda_graph_runner_tc_piecewise.split.split_graph` cuts it into pieces and
   marked-op submodules, in the original order;
2. the split module is run once on Dynamo's fake inputs (symbolic token count); at each
   piece the piece compiler (``eager``: the FX module itself; ``inductor``:
   ``torch._inductor.compile_fx.compile_fx``) compiles it for the *symbolic* shapes its
   inputs have there, so one compilation serves every size;
3. each piece is replaced in the split module by a
   :class:`~cuda_graph_runner_tc_piecewise.piece.GraphPiece`, which captures and
   replays it per size. Marked ops run eagerly, through their FX code's ``forward``
   (no ``nn.Module.__call__`` per op and step), which calls the op's body without the
   custom-op dispatcher (:mod:`~cuda_graph_runner_tc_piecewise.eager_items`).

The split module is what Dynamo then runs for every call that passes its guards; an
``on_graph_call`` hook sees each such call's arguments and outputs (the backend records
them at capture so that a replay can call the split module without Dynamo).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch._guards
import torch.fx as fx

from .eager_items import direct_eager_forward, generated_forward
from .errors import TcPiecewiseCompileError, failing_op, one_line
from .split import SplitGraph, SplitItem, split_graph

logger = logging.getLogger(__name__)

PieceCompiler = Callable[[fx.GraphModule, List[Any]], Callable[..., Any]]


def compile_eager(module: fx.GraphModule, example_inputs: List[Any]) -> Callable[..., Any]:
    """``eager``: run the piece's FX code as traced (the torch ops Dynamo recorded).

    Its generated ``forward`` is returned rather than the module: no ``nn.Module`` call
    overhead, and an error keeps the traceback line of the op that raised (FX's module
    call would print it and strip the traceback).
    """
    return module.forward


def compile_inductor(module: fx.GraphModule, example_inputs: List[Any]) -> Callable[..., Any]:
    """``inductor``: ``compile_fx`` for the piece's (symbolic) example inputs.

    Raises:
        RuntimeError: CUDA inputs but Triton is not installed.
    """
    from torch._inductor.compile_fx import compile_fx

    if any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs):
        from torch.utils._triton import has_triton

        if not has_triton():
            raise RuntimeError("tc_compiler 'inductor' on CUDA needs Triton (pip install triton), or use 'eager'")
    return compile_fx(module, list(example_inputs))  # type: ignore[return-value]  # a callable for a GraphModule


#: Piece compilers by ``tc_compiler`` name. Tests may swap an entry.
PIECE_COMPILERS: Dict[str, PieceCompiler] = {"eager": compile_eager, "inductor": compile_inductor}


@dataclasses.dataclass
class CompiledGraph:
    """One Dynamo graph as the backend compiled it.

    Attributes:
        split: the split graph (items in execution order).
        pieces: the :class:`GraphPiece` (or whatever ``make_piece`` returned) of each
            piece, in order.
        compiler: the piece compiler's name.
        seconds: time spent splitting and compiling (not running).
        forward: the split module's ``forward`` (pieces and marked ops in order), called
            with the graph's flat inputs; returns the graph's output tuple.
    """

    split: SplitGraph
    pieces: List[Any]
    compiler: str
    seconds: float
    forward: Optional[Callable[..., Any]] = None


class _CompileInterpreter(fx.Interpreter):
    """Runs the split module on fake inputs and compiles each piece on the way."""

    def __init__(self, split: SplitGraph, compile_item: Callable[[SplitItem, Sequence[Any]], None]) -> None:
        super().__init__(split.module)
        self._items = {item.name: item for item in split.items}
        self._compile_item = compile_item

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        # Fake outputs first: compiling (inductor) may rewrite the module in place.
        output = super().call_module(target, args, kwargs)
        item = self._items.get(target)
        if item is not None and not item.is_eager:
            self._compile_item(item, args)
        return output


class PiecewiseDynamoBackend:
    """A ``torch.compile`` backend: split at the marked ops, compile and wrap each piece.

    Args:
        compiler: ``"eager"`` or ``"inductor"`` (a key of :data:`PIECE_COMPILERS`).
        make_piece: ``make_piece(split, item, compiled) -> callable`` wraps one compiled
            piece (the backend passes a :class:`GraphPiece` factory).
        on_compiled: called with each :class:`CompiledGraph`.
        on_graph_call: ``on_graph_call(graph, args, outputs)`` after every call Dynamo
            makes into a compiled graph (None: no hook, Dynamo calls the split module).

    Raises (from ``__call__``, which Dynamo wraps in ``BackendCompilerFailed``; the
    backend unwraps it):
        TcPiecewiseCompileError: the piece compiler failed; names the piece, the marked
            ops around it, its ops and, when inductor says so, the failing op.
    """

    def __init__(
        self,
        compiler: str,
        make_piece: Callable[[SplitGraph, SplitItem, Any], Any],
        on_compiled: Callable[[CompiledGraph], None],
        on_graph_call: Optional[Callable[[CompiledGraph, tuple, Any], None]] = None,
    ) -> None:
        if compiler not in PIECE_COMPILERS:
            raise ValueError(f"unknown tc_compiler {compiler!r}; accepted: {', '.join(PIECE_COMPILERS)}")
        self.compiler = compiler
        self.make_piece = make_piece
        self.on_compiled = on_compiled
        self.on_graph_call = on_graph_call

    def __call__(self, gm: fx.GraphModule, example_inputs: List[Any]) -> Callable[..., Any]:
        start = time.perf_counter()
        split = split_graph(gm)
        compile_fn = PIECE_COMPILERS[self.compiler]
        wrapped: Dict[str, Any] = {}

        def compile_item(item: SplitItem, args: Sequence[Any]) -> None:
            try:
                compiled = compile_fn(getattr(split.module, item.name), list(args))
            except Exception as exc:
                op = failing_op(exc)
                raise TcPiecewiseCompileError(
                    f"tc_piecewise: compiler {self.compiler!r} failed on {split.describe(item)}"
                    + (f"; failing op: {op}" if op else "")
                    + f": {one_line(exc)}"
                ) from exc
            wrapped[item.name] = self.make_piece(split, item, compiled)

        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        if fake_mode is not None:
            # Dynamo's fakes (memoized per real tensor) carry the symbolic token count.
            inputs = [
                fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) and not _is_fake(x) else x
                for x in example_inputs
            ]
            from torch._dispatch.python import enable_python_dispatcher

            with fake_mode, enable_python_dispatcher():
                _CompileInterpreter(split, compile_item).run(*inputs)
        else:  # called outside Dynamo (tests): real inputs, static shapes
            _CompileInterpreter(split, compile_item).run(*example_inputs)

        for name, piece in wrapped.items():
            # The split module's code calls self.<name>(...): an instance attribute wins
            # over the registered submodule (vLLM does the same).
            split.module.__dict__[name] = piece
        for item in split.items:
            if item.is_eager:
                # The marked op's FX code itself: no nn.Module call (hooks, wrapped call) per op,
                # calling the op's body without the custom-op dispatcher where that is the same.
                sub = getattr(split.module, item.name)
                split.module.__dict__[item.name] = direct_eager_forward(sub) or generated_forward(sub)
        forward = generated_forward(split.module)  # see compile_eager: no module-call overhead per replay
        result = CompiledGraph(
            split=split,
            pieces=[wrapped[i.name] for i in split.pieces],
            compiler=self.compiler,
            seconds=time.perf_counter() - start,
            forward=forward,
        )
        logger.info(
            "tc_piecewise: split into %d pieces around %d marked ops, compiled with %s in %.2f s",
            len(result.pieces),
            len(split.eager_ops),
            self.compiler,
            result.seconds,
        )
        self.on_compiled(result)
        hook = self.on_graph_call
        if hook is None:
            return forward

        def run_graph(*args: Any) -> Any:
            outputs = forward(*args)
            hook(result, args, outputs)
            return outputs

        return run_graph


def _is_fake(x: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor)
