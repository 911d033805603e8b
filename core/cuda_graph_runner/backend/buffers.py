"""Static input buffers: named slots at fixed addresses that graphs read.

A captured graph reads its inputs from the addresses it saw at capture, so the runner
copies each live batch into preallocated buffers and pads the tail up to the captured
size. Each slot knows its axis and how to pad (sglang's ``CudaGraphBufferRegistry``):

* index-like buffers (token ids, positions, KV slots, request rows) pad with 0, which
  points padded tokens at the reserved dummy slot and row 0;
* sequence lengths pad with a fill value (>= 1) so attention over a padded request
  never divides by an empty softmax.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch

from .nested import map_pairs

BATCH_AXIS = "batch"
TOKEN_AXIS = "token"

_INTEGER_DTYPES = frozenset(
    (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64)
)
_FLOAT_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))


def accepted_source_dtypes(dtype: torch.dtype) -> frozenset:
    """The source dtypes a copy into a slot of ``dtype`` accepts: the same kind (any
    integer width for an integer slot, as an engine's int64 ``seq_lens`` into the int32
    slot; any float width for a float slot; only ``dtype`` itself otherwise). A copy
    across kinds (float token ids into int64, bools into int) would be cast silently
    where the eager forward raises or computes something else."""
    for kind in (_INTEGER_DTYPES, _FLOAT_DTYPES):
        if dtype in kind:
            return kind
    return frozenset((dtype,))


def dtype_mismatch(name: str, src: torch.Tensor, slot_dtype: torch.dtype, what: str = "") -> ValueError:
    """The error for a source of another dtype kind than its slot (names the field, both dtypes)."""
    kind = "an integer dtype" if slot_dtype in _INTEGER_DTYPES else "a float dtype"
    if slot_dtype not in _INTEGER_DTYPES and slot_dtype not in _FLOAT_DTYPES:
        kind = str(slot_dtype)
    return ValueError(
        f"{what or f'the batch field {name!r}'} is {src.dtype}, expected {slot_dtype} ({kind} is accepted and "
        "copied into the static buffer); a copy across dtype kinds would be cast silently on replay"
    )


@dataclasses.dataclass
class BufferSlot:
    """One static buffer.

    Attributes:
        name: slot name (usually the ``ForwardBatch`` field it mirrors).
        axis: ``"batch"`` (one row per request) or ``"token"`` (one row per token).
        tensor: ``[rows, *trailing]`` buffer, allocated once.
        pad_value: what padded rows hold.
        dirty: rows ``dirty:`` hold ``pad_value`` for sure; rows before it may hold a
            live batch's data. Lets a fill pad only the rows an earlier, larger batch
            left behind instead of the whole tail every step (0 after allocation and
            :meth:`CudaGraphBufferRegistry.reset`).
    """

    name: str
    axis: str
    tensor: torch.Tensor
    pad_value: float = 0
    dirty: int = 0

    @property
    def rows(self) -> int:
        return int(self.tensor.shape[0])


class CudaGraphBufferRegistry:
    """Named static buffers on one device.

    Args:
        device: where buffers live.
    """

    def __init__(self, device: "torch.device | str") -> None:
        self.device = torch.device(device)
        self._slots: Dict[str, BufferSlot] = {}

    def register(
        self,
        name: str,
        *,
        axis: str,
        rows: int,
        dtype: torch.dtype,
        pad_value: float = 0,
        trailing_shape: Sequence[int] = (),
    ) -> torch.Tensor:
        """Allocate slot ``name`` of ``[rows, *trailing_shape]`` filled with ``pad_value``.

        Raises:
            ValueError: duplicate name, unknown axis or non-positive rows.
        """
        if name in self._slots:
            raise ValueError(f"buffer {name!r} is already registered")
        if axis not in (BATCH_AXIS, TOKEN_AXIS):
            raise ValueError(f"buffer {name!r}: axis must be {BATCH_AXIS!r} or {TOKEN_AXIS!r}, got {axis!r}")
        if rows <= 0:
            raise ValueError(f"buffer {name!r}: rows must be positive, got {rows}")
        tensor = torch.full((rows, *trailing_shape), pad_value, dtype=dtype, device=self.device)
        self._slots[name] = BufferSlot(name, axis, tensor, pad_value)
        return tensor

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._slots[name].tensor

    def __contains__(self, name: str) -> bool:
        return name in self._slots

    def __iter__(self) -> Iterator[BufferSlot]:
        return iter(self._slots.values())

    def slot(self, name: str) -> BufferSlot:
        return self._slots[name]

    def names(self, axis: Optional[str] = None) -> List[str]:
        return [s.name for s in self._slots.values() if axis is None or s.axis == axis]

    def view(self, name: str, rows: int) -> torch.Tensor:
        """The first ``rows`` rows of slot ``name`` (a view at a fixed address)."""
        return self._slots[name].tensor[:rows]

    def fill(self, name: str, src: torch.Tensor, padded_rows: int) -> torch.Tensor:
        """Copy ``src`` into the head of slot ``name`` and pad rows ``len(src):padded_rows``.

        Returns the ``[padded_rows, ...]`` view.

        Raises:
            ValueError: ``src`` has more rows than ``padded_rows`` or than the slot holds,
                or a dtype of another kind than the slot's (:func:`accepted_source_dtypes`).
        """
        slot = self._slots[name]
        if src.dtype not in accepted_source_dtypes(slot.tensor.dtype):
            raise dtype_mismatch(name, src, slot.tensor.dtype, f"the source of buffer {name!r}")
        n = int(src.shape[0])
        if n > padded_rows or padded_rows > slot.rows:
            raise ValueError(
                f"buffer {name!r}: cannot place {n} rows padded to {padded_rows} in a buffer of {slot.rows} rows"
            )
        slot.tensor[:n].copy_(src, non_blocking=True)
        pad_tail(slot, n, padded_rows)
        return slot.tensor[:padded_rows]

    def reset(self) -> None:
        """Refill every slot with its pad value (before a recapture)."""
        for slot in self._slots.values():
            slot.tensor.fill_(slot.pad_value)
            slot.dirty = 0

    def nbytes(self) -> int:
        """Bytes held by all slots."""
        return sum(s.tensor.numel() * s.tensor.element_size() for s in self._slots.values())


def pad_tail(slot: BufferSlot, rows: int, padded_rows: int) -> None:
    """After rows ``:rows`` of ``slot`` were written, make rows ``rows:padded_rows`` hold
    the pad value, filling only those an earlier batch may have written (``slot.dirty``):
    a steady batch size pads nothing."""
    dirty = slot.dirty
    if dirty > rows and padded_rows > rows:
        slot.tensor[rows : min(dirty, padded_rows)].fill_(slot.pad_value)
    slot.dirty = dirty if dirty > padded_rows else rows


class FusedFill:
    """Copies a live batch into several slots at once, for one (live rows, padded rows) shape.

    Built once per live size and reused every step (no per-step views or objects): the
    destinations ``slot.tensor[:rows]`` are made here, the copies go through
    ``torch._foreach_copy_`` (one call per dtype group: on CUDA one fused kernel per
    group instead of a copy per slot), and the padding only refills rows an earlier,
    larger batch left behind (:func:`pad_tail`). Idea: sglang's fused input-buffer
    copy of its CUDA-graph runner; vLLM pads its persistent buffers once and rewrites
    only the live rows.

    Args:
        registry: the buffers.
        names: slot names, in the order :meth:`__call__` gets the sources.
        rows: live rows per slot (each source must have exactly this many).
        padded_rows: rows of each slot the graph reads.

    Raises:
        ValueError: a size exceeds its slot, or ``rows > padded_rows``.
    """

    def __init__(
        self, registry: "CudaGraphBufferRegistry", names: Sequence[str], rows: Sequence[int], padded_rows: Sequence[int]
    ) -> None:
        self.names = tuple(names)
        self.rows = tuple(int(r) for r in rows)
        self.slots = [registry.slot(n) for n in self.names]
        groups: Dict[torch.dtype, List[int]] = {}
        for i, (slot, n, padded) in enumerate(zip(self.slots, self.rows, padded_rows)):
            if n > padded or padded > slot.rows:
                raise ValueError(
                    f"buffer {slot.name!r}: cannot place {n} rows padded to {padded} in a buffer of {slot.rows} rows"
                )
            groups.setdefault(slot.tensor.dtype, []).append(i)
        self.groups = [([self.slots[i].tensor[: self.rows[i]] for i in idx], tuple(idx)) for idx in groups.values()]
        self.pads = [(slot, n, int(p)) for slot, n, p in zip(self.slots, self.rows, padded_rows)]
        # Per slot (rows, accepted source dtypes, name, dtype): one tuple walk per step.
        self.checks = tuple(
            (n, accepted_source_dtypes(slot.tensor.dtype), name, slot.tensor.dtype)
            for slot, n, name in zip(self.slots, self.rows, self.names)
        )

    def __call__(self, srcs: Sequence[torch.Tensor]) -> None:
        """Copy ``srcs[i]`` (``[rows[i], ...]``, a dtype of the slot's kind:
        :func:`accepted_source_dtypes`) into slot ``names[i]`` and pad it to ``padded_rows[i]``.

        The checks are per tensor, never per element (a shape and a dtype lookup each).

        Raises:
            ValueError: a source does not have its ``rows`` rows (a copy would broadcast),
                or has a dtype of another kind than its slot (a copy would cast silently).
        """
        for src, (n, accepted, name, dtype) in zip(srcs, self.checks):
            if src.shape[0] != n:
                raise ValueError(f"buffer {name!r}: the batch's {name} has {src.shape[0]} rows, expected {n}")
            if src.dtype not in accepted:
                raise dtype_mismatch(name, src, dtype)
        for dsts, idx in self.groups:
            torch._foreach_copy_(dsts, [srcs[i] for i in idx], non_blocking=True)
        for slot, n, padded in self.pads:
            if slot.dirty != n:
                pad_tail(slot, n, padded)


def copy_into(dst: Any, src: Any) -> None:
    """Copy ``src`` into ``dst`` in place, tensor by tensor, through any structure the
    walker supports (tuples, NamedTuples, lists, dicts, dataclasses;
    :mod:`cuda_graph_runner.backend.nested`): how a replay-by-rerun refreshes the tensors a capture
    returned.

    Raises:
        ValueError: ``src`` has another structure than ``dst``, or a non-tensor where
            ``dst`` holds a tensor (naming the path).
    """

    def copy(d: torch.Tensor, s: Any) -> None:
        if not isinstance(s, torch.Tensor):
            raise ValueError(
                f"copy_into: expected a tensor to copy into a {tuple(d.shape)} tensor, got a {type(s).__name__}"
            )
        d.copy_(s)

    map_pairs(copy, dst, src, where="copy_into")
