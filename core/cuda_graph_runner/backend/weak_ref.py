"""Non-owning tensor aliases, for graph outputs and arguments kept across captures.

A captured graph writes its outputs into graph-pool memory. If the backend keeps the
output tensors themselves, every size pins its own outputs and the pool grows with the
sum of all sizes. Keeping non-owning aliases instead returns those blocks to the pool
after capture, so the next (smaller) capture reuses them: the pool then holds about the
largest size alone. It is safe because graphs of one pool never replay concurrently and
an output is only valid until the next replay anyway (vLLM ``weak_ref_tensors``; torch's
cudagraph trees build the alias with the same private helper).
"""

from __future__ import annotations

from typing import Any

import torch

from .nested import map_tensors

_make_storage = getattr(torch._C, "_construct_storage_from_data_pointer", None)


def weak_ref_tensor(tensor: Any) -> Any:
    """A tensor viewing ``tensor``'s memory without owning it; non-tensors pass through.

    Same dtype, device, size, stride, storage offset and ``data_ptr()``. Valid only while
    something else keeps the memory allocated (for graph-pool memory: the pool, pinned by
    the captured graphs). Where torch lacks the helper, ``tensor`` itself is returned
    (correct, only larger pools).
    """
    if not isinstance(tensor, torch.Tensor) or _make_storage is None:
        return tensor
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return tensor  # nothing to alias; holding it pins no memory
    alias_storage = _make_storage(storage.data_ptr(), tensor.device, storage.nbytes())
    alias = torch.empty((0,), dtype=tensor.dtype, device=tensor.device)
    return alias.set_(alias_storage, tensor.storage_offset(), tensor.size(), tensor.stride())


def weak_ref_tensors(value: Any) -> Any:
    """:func:`weak_ref_tensor` on every tensor of a nested structure (tuples, NamedTuples,
    lists, dicts, dataclasses; :mod:`cuda_graph_runner.backend.nested`), rebuilt with the same
    types; anything else passes through."""
    return map_tensors(weak_ref_tensor, value)
