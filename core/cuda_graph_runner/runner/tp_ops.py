"""The model's collectives as opaque custom ops, so Dynamo traces through them.

``torch.compile`` (the ``tc_piecewise`` backend) must trace a tensor-parallel model's
forward into one graph whose token axis is symbolic. Dynamo (torch 2.13) rewrites an
in-place ``dist.all_reduce`` into functional collectives (``_c10d_functional::all_reduce``,
``wait_tensor``, a ``copy_`` back): asynchronous work on the process group's own
stream, handles and waits inside the pieces, and collectives inductor may move. Here each
collective is one ``torch.library.custom_op`` instead, which runs exactly the call eager
runs:

* ``cuda_graph_runner::tp_all_reduce(Tensor x, str group) -> Tensor``: the sum over
  the group, in a new tensor (``x`` is untouched);
* ``cuda_graph_runner::tp_all_gather_last_dim(Tensor x, str group, int size) -> Tensor``:
  every rank's ``x`` ``[..., n]`` concatenated along the last dim, ``[..., size * n]``;
* ``cuda_graph_runner::tp_all_gather_rows(Tensor x, str group, int size) -> Tensor``:
  every rank's ``x`` ``[n, ...]`` stacked along dim 0, ``[size * n, ...]`` (the
  data-parallel layout's row gather, :mod:`cuda_graph_runner.runner.dp_group`).

Both have a fake (meta) implementation, so Dynamo and inductor see a node with known
output shape (symbolic sizes included: no recompile per captured size) and never look
inside; at run time the real implementation calls ``torch.distributed`` on the
current stream, which inside a piece's CUDA-graph capture is the capture stream (the
collective is recorded into the piece's graph). The ops are functional (out of place):
no mutation for AOT autograd to functionalize, at the cost of one copy of the
activation per all-reduce (``[tokens, hidden]``).

The group is passed by name (a string is a graph constant, a ``ProcessGroup`` is not);
:func:`register_group` maps names to live :class:`~cuda_graph_runner.runner.distributed.TPGroup`
objects. The name holds the rank, so each rank's traced graph (and with it inductor's
cache key) is its own.

Borrowed from vLLM (``vllm/distributed/parallel_state.py``: the ``vllm::all_reduce``
custom op with ``torch.empty_like`` as its fake, groups looked up by unique name) and
sglang (``sglang/srt/distributed/parallel_state.py``: ``inplace_all_reduce`` /
``outplace_all_reduce`` registered as custom ops for its torch.compile path).
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .distributed import TPGroup

__all__ = ["all_gather_last_dim_op", "all_gather_rows_op", "all_reduce_op", "group_by_name", "register_group"]

_GROUPS: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()
_COUNTER = itertools.count()


def register_group(tp: "TPGroup") -> str:
    """Give ``tp`` a process-wide name the custom ops can find it by; returns the name.

    ``"tp<size>-rank<rank>-<n>"``, ``n`` counting the groups this process registered
    (the same on every run that creates its groups in the same order, so inductor's
    cache keys repeat across runs). The registry holds the group weakly.
    """
    name = f"tp{tp.size}-rank{tp.rank}-{next(_COUNTER)}"
    _GROUPS[name] = tp
    return name


def group_by_name(name: str) -> "TPGroup":
    """The live group registered as ``name``.

    Raises:
        KeyError: no live group has that name (names the registered ones).
    """
    tp = _GROUPS.get(name)
    if tp is None:
        raise KeyError(
            f"no tensor-parallel group named {name!r} (it was garbage collected or never registered); "
            f"live groups: {sorted(_GROUPS.keys())}"
        )
    return tp


@torch.library.custom_op("cuda_graph_runner::tp_all_reduce", mutates_args=())
def all_reduce_op(x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum of ``x`` over the group named ``group``, in a new tensor (same shape, dtype, device)."""
    import torch.distributed as dist

    out = x.clone()
    dist.all_reduce(out, group=group_by_name(group).group)
    return out


@all_reduce_op.register_fake
def _all_reduce_fake(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("cuda_graph_runner::tp_all_gather_last_dim", mutates_args=())
def all_gather_last_dim_op(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
    """Every rank's ``x`` ``[..., n]`` joined along the last dim in rank order: ``[..., size * n]``."""
    from .distributed import _gather_last_dim

    return _gather_last_dim(x, group_by_name(group))


@all_gather_last_dim_op.register_fake
def _all_gather_last_dim_fake(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], size * x.shape[-1]))


@torch.library.custom_op("cuda_graph_runner::tp_all_gather_rows", mutates_args=())
def all_gather_rows_op(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
    """Every rank's ``x`` ``[n, ...]`` stacked along dim 0 in rank order: ``[size * n, ...]``."""
    from .distributed import gather_rows

    return gather_rows(x, group_by_name(group))


@all_gather_rows_op.register_fake
def _all_gather_rows_fake(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
    return x.new_empty((size * x.shape[0], *x.shape[1:]))
