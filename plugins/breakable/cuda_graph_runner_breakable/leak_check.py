"""Breakable's leaked-output check (a debug switch): tensors a marked op makes between
segments and a later segment reads without the op declaring them.

A marked op runs eagerly between two segments. At replay it runs again and makes *new*
tensors, while the segments replay the kernels of the capture, which read the addresses
of the capture's tensors. So only what the op *declares* reaches the next segment: the
arguments it mutates (``mutates_args``, ``output`` by default: the segment before it
allocated them, in the graph pool) and what it returns (held for the graph's lifetime,
copied into at every replay). A tensor the op makes and hands on any other way (a module
attribute, ``forward_scratch``, a closure, a global cache) is read by the next segment at
the capture's address, holding the capture's values: a replay reads stale data, silently.
vLLM's breakable wrapper states the same invariant (an eager break writes in place into
a caller-provided output buffer); this check finds the breaches.

How: during one shape's capture, a ``TorchDispatchMode`` notes every tensor an eager op's
aten calls make (a result whose storage is not among that call's inputs), minus the
op's returned tensors; the segments' aten calls, the later eager ops' tensor arguments
(replayed as captured) and the forward's output are then checked against those storages.
Each hit is a leak, reported with the op's name, what reads it and the tensor's shape
and dtype. The noted tensors are held until the shape's capture ends, so their addresses
are not reused meanwhile (no false matches; debug memory only).

Costs Python per aten call during capture only (replay is untouched); off by default.
Limits: a tensor the op makes on its first call and writes in place on every later call
(a lazily allocated persistent buffer) is made during the warm-ups, before the check
runs, so it is not reported; ``marked_op_bodies`` replacements are not used while the
check runs (the op's own body is).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from cuda_graph_runner.backend import NAMESPACE, EagerOp, iter_tensors, registered_eager_ops, run_marked_op

__all__ = ["Leak", "LeakCheck"]


def _storage(t: torch.Tensor) -> Optional[int]:
    try:
        if t.numel() == 0:
            return None
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, subclasses)
        return None


@dataclasses.dataclass(frozen=True)
class Leak:
    """One undeclared tensor of a marked op, read after the op.

    Attributes:
        op: the marked op's qualified name (``cuda_graph_runner::<name>``).
        reader: what reads it (``"segment 2 (aten::add.Tensor)"``, ``"marked op ... argument
            'x'"``, ``"the forward's output"``).
        shape, dtype: of the tensor the op made.
    """

    op: str
    reader: str
    shape: Tuple[int, ...]
    dtype: torch.dtype

    def describe(self) -> str:
        return f"{self.op} made a {list(self.shape)} {self.dtype} tensor that {self.reader} reads"


class LeakCheck(TorchDispatchMode):
    """The check of one shape's capture (see the module docstring). Enter it around the
    captured forward; the backend calls :meth:`run_op` for each eager break,
    :meth:`check_args` before it, :meth:`next_segment` after it and :meth:`check_output`
    at the end; :attr:`leaks` then holds what was found."""

    def __init__(self) -> None:
        super().__init__()
        self.leaks: List[Leak] = []
        self._op: Optional[EagerOp] = None
        self._paused = 0
        self._segment = 0
        # storage -> (the op that made it, the tensor, held so its address stays its own)
        self._made: Dict[int, Tuple[EagerOp, torch.Tensor]] = {}
        self._seen: Set[Tuple[int, str]] = set()

    # -- the backend's calls ------------------------------------------------------------
    def run_op(self, op: EagerOp, call: Any) -> Any:
        """``call()`` (the eager op) with what it makes noted as ``op``'s, minus what it
        returns."""
        outer = self._op
        self._op = op
        try:
            result = call()
        finally:
            self._op = outer
        for _, tensor in iter_tensors(result):
            key = _storage(tensor)
            if key is not None:
                self._made.pop(key, None)
        return result

    def next_segment(self) -> None:
        self._segment += 1

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The backend's own bookkeeping (argument freezing) is no segment read."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def check_args(self, op: EagerOp, named: Iterator[Tuple[str, torch.Tensor]]) -> None:
        """A later eager op replays with its capture-time arguments: one made by an
        earlier op and not declared is a leak."""
        for where, tensor in named:
            self._hit(tensor, f"marked op {op.qualname!r} (argument {where}, replayed as captured)")

    def check_output(self, output: Any) -> None:
        for where, tensor in iter_tensors(output, where="output"):
            self._hit(tensor, f"the forward's {where} (kept as the graph's output)")

    def forget(self) -> None:
        """Drop the noted tensors (the shape's capture ended)."""
        self._made.clear()
        self._seen.clear()

    # -- the dispatch mode --------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        op = self._op
        if op is None or self._paused:
            if not self._paused and self._made:
                name = func.name()
                for t in tree_flatten((args, kwargs))[0]:
                    if isinstance(t, torch.Tensor):
                        self._hit(t, f"segment {self._segment} ({name})")
            return func(*args, **kwargs)
        if func.namespace == NAMESPACE:
            # The marked op's custom op: run its body with this mode on, so its aten calls
            # are seen (the custom op itself is one opaque call to a dispatch mode).
            marked = registered_eager_ops().get(func.name().split("::")[-1].split(".")[0])
            if marked is not None:
                with self:
                    return run_marked_op(marked.fn, args, kwargs)
        out = func(*args, **kwargs)
        inputs = {k for k in (_storage(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)) if k}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                key = _storage(t)
                if key is not None and key not in inputs and key not in self._made:
                    self._made[key] = (op, t)
        return out

    def _hit(self, tensor: torch.Tensor, reader: str) -> None:
        key = _storage(tensor)
        if key is None:
            return
        made = self._made.get(key)
        if made is None:
            return
        op, original = made
        seen = (key, reader.split(" (")[0])  # one report per tensor and reader
        if seen in self._seen:
            return
        self._seen.add(seen)
        self.leaks.append(Leak(op.qualname, reader, tuple(original.shape), original.dtype))
