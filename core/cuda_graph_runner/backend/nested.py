"""One walker over nested outputs: the structures a model may return from a graph.

Every place that looks inside a model's output (or a marked op's arguments) goes
through this module: slicing off padded rows (:func:`cuda_graph_runner.runner.base.slice_rows`),
non-owning aliases (:func:`cuda_graph_runner.backend.weak_ref.weak_ref_tensors`), in-place
refresh (:func:`cuda_graph_runner.backend.buffers.copy_into`), owned copies
(:func:`clone_tensors`), and the breakable plugin's argument handling. One walker means
one answer to "which structures work", on every path (eager, replay, every backend).

Containers walked, and how each is rebuilt:

* ``tuple`` -> ``tuple(items)``; a ``NamedTuple`` -> ``type(x)(*items)`` (its ``__new__``
  takes fields positionally, so ``type(x)(items)`` would fail or misassign); a torch
  struct sequence (``torch.return_types.*``) -> ``type(x)(items)``;
* ``list`` -> ``list(items)`` (a subclass: a shallow copy whose items are replaced);
* ``dict`` and subclasses (``OrderedDict``, ``defaultdict``) -> a shallow copy with the
  values replaced, keys and order kept;
* dataclass instances -> ``dataclasses.replace(x, **init_fields)``, then fields with
  ``init=False`` are set on the copy (``object.__setattr__``, so frozen ones work).

Leaves: tensors, and constants returned as they are (``None``, ``bool``, ``int``,
``float``, ``complex``, ``str``, ``bytes``, ``torch.dtype``, ``torch.device``,
``torch.Size``, enum members). Anything else is *unsupported*: :func:`check_structure`
(called by the runners on the first capture-time run of the forward) raises
:class:`UnsupportedStructureError` naming the type and where it sits; the lenient
walkers (``strict=False``, for marked-op arguments that may be modules or callables)
pass it through untouched.

The container set is the one ``torch.utils._pytree`` flattens by default (vLLM and
sglang walk outputs with it); a local walker keeps the rebuild rules, the paths in
error messages and the leaf policy in one place and independent of a private API.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from typing import Any, Callable, Iterator, List, Tuple

import torch

from ..config.exceptions import CudaGraphRunnerError

__all__ = [
    "UnsupportedStructureError",
    "SUPPORTED_STRUCTURES",
    "map_tensors",
    "iter_tensors",
    "map_pairs",
    "check_structure",
    "clone_tensors",
]

#: For error messages: what a graph output may be made of.
SUPPORTED_STRUCTURES = (
    "tensors nested in tuples, NamedTuples, lists, dicts and dataclasses, with None/bool/int/float/str constants"
)

_CONSTANTS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, enum.Enum)


class UnsupportedStructureError(CudaGraphRunnerError, TypeError):
    """A model output holds a type the walker cannot look inside (or rebuild).

    Attributes:
        path: where it sits, e.g. ``"decode graph output['logits'][1]"``.
        type_name: the qualified name of its type.
    """

    def __init__(self, path: str, value: Any) -> None:
        self.path = path
        cls = type(value)
        self.type_name = f"{cls.__module__}.{cls.__qualname__}"
        super().__init__(
            f"{path} is a {self.type_name}, which cuda-graph-runner cannot slice, alias or copy; "
            f"supported: {SUPPORTED_STRUCTURES}. Return one of those (e.g. turn the object into a "
            "NamedTuple or a dataclass)"
        )


# -- classification -------------------------------------------------------------------------

_TENSOR, _CONSTANT, _NAMEDTUPLE, _STRUCTSEQ, _TUPLE, _LIST, _DICT, _DATACLASS, _OTHER = range(9)


def _kind(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return _TENSOR
    if isinstance(value, _CONSTANTS):  # torch.Size (a tuple) is a constant, checked first
        return _CONSTANT
    cls = type(value)
    if isinstance(value, tuple):
        if cls is tuple:
            return _TUPLE
        if hasattr(cls, "_fields"):
            return _NAMEDTUPLE
        if hasattr(cls, "n_sequence_fields"):
            return _STRUCTSEQ
        return _OTHER
    if isinstance(value, list):
        return _LIST
    if isinstance(value, dict):
        return _DICT
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _DATACLASS
    return _OTHER


def _children(value: Any, kind: int) -> List[Tuple[str, Any]]:
    """``(path suffix, child)`` pairs of a container, in order."""
    if kind in (_TUPLE, _LIST, _STRUCTSEQ):
        return [(f"[{i}]", v) for i, v in enumerate(value)]
    if kind == _NAMEDTUPLE:
        return [(f".{name}", v) for name, v in zip(type(value)._fields, value)]
    if kind == _DICT:
        return [(f"[{k!r}]", v) for k, v in value.items()]
    if kind == _DATACLASS:
        return [(f".{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)]
    return []


def _rebuild(value: Any, kind: int, items: List[Any]) -> Any:
    """A container like ``value`` holding ``items`` (in :func:`_children` order)."""
    if kind == _TUPLE:
        return tuple(items)
    if kind == _NAMEDTUPLE:
        return type(value)(*items)
    if kind == _STRUCTSEQ:
        return type(value)(items)
    if kind == _LIST:
        if type(value) is list:
            return items
        new = copy.copy(value)
        new[:] = items
        return new
    if kind == _DICT:
        new = copy.copy(value)  # keeps the class (OrderedDict, defaultdict's factory) and key order
        for key, item in zip(list(value), items):
            new[key] = item
        return new
    if kind == _DATACLASS:
        fields = dataclasses.fields(value)
        new = dataclasses.replace(value, **{f.name: v for f, v in zip(fields, items) if f.init})
        for f, v in zip(fields, items):
            if not f.init:
                object.__setattr__(new, f.name, v)
        return new
    raise AssertionError(f"not a container kind: {kind}")


# -- walkers ------------------------------------------------------------------------------


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any, *, strict: bool = False, where: str = "output") -> Any:
    """``value`` rebuilt with ``fn(t)`` in place of every tensor ``t``.

    Args:
        fn: called once per tensor leaf, depth first, in container order.
        value: a tensor, constant or container (see the module docstring).
        strict: raise on an unsupported type instead of passing it through.
        where: the name of ``value`` in error messages.

    Raises:
        UnsupportedStructureError: ``strict`` and an unsupported type is found.
    """
    kind = _kind(value)
    if kind == _TENSOR:
        return fn(value)
    if kind == _CONSTANT:
        return value
    if kind == _OTHER:
        if strict:
            raise UnsupportedStructureError(where, value)
        return value
    children = _children(value, kind)
    items = [map_tensors(fn, child, strict=strict, where=where + suffix) for suffix, child in children]
    return _rebuild(value, kind, items)


def iter_tensors(value: Any, *, strict: bool = False, where: str = "output") -> Iterator[Tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for every tensor leaf of ``value``, depth first.

    Paths extend ``where``: ``where[0]``, ``where['key']``, ``where.field``.

    Raises:
        UnsupportedStructureError: ``strict`` and an unsupported type is found.
    """
    kind = _kind(value)
    if kind == _TENSOR:
        yield where, value
    elif kind == _OTHER:
        if strict:
            raise UnsupportedStructureError(where, value)
    elif kind != _CONSTANT:
        for suffix, child in _children(value, kind):
            yield from iter_tensors(child, strict=strict, where=where + suffix)


def map_pairs(fn: Callable[[torch.Tensor, Any], None], dst: Any, src: Any, *, where: str = "output") -> None:
    """Call ``fn(d, s)`` for each tensor ``d`` of ``dst`` and the value ``s`` at the same
    place in ``src`` (copying a new result into the tensors a capture returned, for one).

    Raises:
        ValueError: ``src`` has another structure (container type, length, keys or
            fields), naming the path; a silent partial copy would be a wrong result.
    """
    kind = _kind(dst)
    if kind == _TENSOR:
        fn(dst, src)
        return
    if kind in (_CONSTANT, _OTHER):
        return
    if _kind(src) != kind or (kind in (_NAMEDTUPLE, _STRUCTSEQ, _DATACLASS) and type(src) is not type(dst)):
        raise ValueError(f"{where}: expected a {type(dst).__name__}, got a {type(src).__name__}")
    dst_children, src_children = _children(dst, kind), _children(src, kind)
    if [s for s, _ in dst_children] != [s for s, _ in src_children]:
        raise ValueError(
            f"{where}: the structure changed: {[s for s, _ in dst_children]} != {[s for s, _ in src_children]}"
        )
    for (suffix, d), (_, s) in zip(dst_children, src_children):
        map_pairs(fn, d, s, where=where + suffix)


def check_structure(value: Any, *, where: str = "output") -> None:
    """Raise if ``value`` holds anything the walker does not support.

    Raises:
        UnsupportedStructureError: naming the type and its path.
    """
    for _ in iter_tensors(value, strict=True, where=where):
        pass


def clone_tensors(value: Any, *, aliasing: Any = None) -> Any:
    """``value`` with its tensors cloned: an owned copy that no later replay can change.

    Args:
        value: a supported structure.
        aliasing: None clones every tensor; otherwise only the tensors of ``value`` that
            share memory with a tensor of ``aliasing`` (same storage base pointer) are
            cloned, the others are already owned (e.g. logits a runner computed eagerly
            from a graph's hidden states). Empty tensors are always cloned (free).

    Returns:
        The rebuilt structure (containers are new; constants are shared).
    """
    if aliasing is None:
        return map_tensors(lambda t: t.clone(), value)
    pointers = {_storage_ptr(t) for _, t in iter_tensors(aliasing)}
    pointers.discard(0)

    def own(t: torch.Tensor) -> torch.Tensor:
        ptr = _storage_ptr(t)
        return t.clone() if ptr == 0 or ptr in pointers else t

    return map_tensors(own, value)


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, some subclasses)
        return 0
