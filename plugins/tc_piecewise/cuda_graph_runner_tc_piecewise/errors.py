"""Errors of the tc_piecewise backend, and helpers that make their messages name the op."""

from __future__ import annotations

import re
import traceback
from typing import Iterator, Optional

from cuda_graph_runner.backend import CudaGraphRunnerError


class TcPiecewiseCompileError(CudaGraphRunnerError, RuntimeError):
    """torch.compile could not trace the model, or the piece compiler failed on a piece.

    The message names the model's forward (trace failures, with Dynamo's own account of
    the offending line) or the piece (its index, the marked ops around it, its ops) and,
    when the compiler says so, the failing op. The original exception is chained.
    """


class TcPiecewiseRuntimeError(CudaGraphRunnerError, RuntimeError):
    """A piece failed while compiling, warming up or capturing a size.

    The message names the piece, the size and, when the traceback shows it, the line of
    generated code (the op) that failed. The original exception is chained. Errors
    during replay are not wrapped (they propagate unchanged).
    """


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and its causes/contexts (and Dynamo's ``inner_exception``), each once."""
    seen = set()
    todo: list[Optional[BaseException]] = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo.extend([getattr(e, "inner_exception", None), e.__cause__, e.__context__])


_TARGET_LINE = re.compile(r"^\s*target: (\S+)", re.MULTILINE)


def failing_op(exc: BaseException) -> Optional[str]:
    """The op a compiler blamed, if any: a ``target`` attribute, or the ``target: <op>``
    line inductor's ``LoweringException`` puts in its message."""
    for e in exception_chain(exc):
        target = getattr(e, "target", None)
        if target is not None and not isinstance(target, (int, float, bool)):
            return str(target)
        found = _TARGET_LINE.search(str(e))
        if found:
            return found.group(1)
    return None


def failing_line(exc: BaseException) -> Optional[str]:
    """The last traceback line inside generated code (FX ``<eval_with_key>`` or an
    inductor output module): the op that raised, as the generated code calls it."""
    found = None
    for e in exception_chain(exc):
        for frame in traceback.extract_tb(e.__traceback__):
            name = frame.filename or ""
            if (name.startswith("<eval_with_key") or "torchinductor" in name) and frame.line:
                found = frame.line.strip()
        if found:
            return found
    return None


def one_line(exc: BaseException, limit: int = 500) -> str:
    """``Type: first line of the message`` (at most ``limit`` characters)."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= limit else text[: limit - 3] + "..."
