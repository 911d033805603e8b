"""A paged KV cache (page size 1) for the reference model.

Layout follows sglang's ``ReqToTokenPool`` + ``MHATokenToKVPool``:

* ``k_buffers[layer]`` / ``v_buffers[layer]``: ``[num_slots, num_kv_heads, head_dim]``
  in the model dtype; one *slot* holds one token's K (or V) for one layer.
* ``req_to_token``: ``[max_reqs, max_context_len]`` int64; ``req_to_token[row, pos]`` is
  the slot of token ``pos`` of the request living in ``row``.

Slot 0 and request row 0 are reserved dummies (row 0 stays all zeros): padded tokens
write into slot 0 and padded requests read row 0, so padding never touches live data.

Every tensor is allocated once in ``__init__`` and only ever written in place, so its
address is fixed for the cache's lifetime: captured graphs may bake it in.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple, Union

import torch

from ..config.exceptions import CudaGraphRunnerError


class CacheFullError(CudaGraphRunnerError, RuntimeError):
    """No free request row or not enough free KV slots."""


class PagedKVCache:
    """Per-layer K/V slot buffers plus a request-to-token table, with simple allocators.

    Args:
        num_layers: decoder layers (one K and one V buffer each).
        num_kv_heads, head_dim: per-token K/V shape.
        num_slots: slots per buffer, including the reserved slot 0 (usable: ``num_slots - 1``).
        max_reqs: rows of ``req_to_token``, including the reserved row 0
            (usable: ``max_reqs - 1``).
        max_context_len: columns of ``req_to_token``: the longest request (prompt plus
            generated tokens) the cache can hold.
        dtype, device: of the K/V buffers; ``req_to_token`` is int64 on ``device``.

    Attributes:
        k_buffers, v_buffers: lists of ``[num_slots, num_kv_heads, head_dim]`` tensors.
        req_to_token: ``[max_reqs, max_context_len]`` int64.

    Raises:
        ValueError: a size is too small (fewer than 2 slots or rows, context < 1).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_slots: int,
        max_reqs: int,
        max_context_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: Union[str, torch.device] = "cpu",
    ) -> None:
        if num_slots < 2:
            raise ValueError(f"num_slots={num_slots}: need at least 2 (slot 0 is a reserved dummy)")
        if max_reqs < 2:
            raise ValueError(f"max_reqs={max_reqs}: need at least 2 (row 0 is a reserved dummy)")
        if max_context_len < 1:
            raise ValueError(f"max_context_len={max_context_len}: must be >= 1")
        if num_layers < 1 or num_kv_heads < 1 or head_dim < 1:
            raise ValueError(
                f"num_layers={num_layers}, num_kv_heads={num_kv_heads}, head_dim={head_dim}: all must be >= 1"
            )
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_slots = num_slots
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.dtype = dtype
        self.device = torch.device(device)

        shape = (num_slots, num_kv_heads, head_dim)
        # Zeros, not empty: slot 0 is read by padded requests and must hold finite values.
        self.k_buffers: List[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]
        self.v_buffers: List[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]
        self.req_to_token = torch.zeros((max_reqs, max_context_len), dtype=torch.int64, device=self.device)
        self._flat_table = self.req_to_token.view(-1)  # the same memory, for write_table

        # Host-side free lists, popped from the end so allocation hands out ascending ids.
        self._free_slots: List[int] = list(range(num_slots - 1, 0, -1))
        self._free_rows: List[int] = list(range(max_reqs - 1, 0, -1))
        self._row_slots: Dict[int, List[int]] = {}  # live row -> its slots, by position

    # -- sizes -------------------------------------------------------------------------

    @property
    def num_free_slots(self) -> int:
        """Slots not allocated (slot 0 never counts)."""
        return len(self._free_slots)

    @property
    def num_free_requests(self) -> int:
        """Request rows not allocated (row 0 never counts)."""
        return len(self._free_rows)

    def request_len(self, row: int) -> int:
        """Tokens currently assigned to ``row`` (its KV length).

        Raises:
            KeyError: ``row`` is not allocated.
        """
        return len(self._live(row))

    # -- allocation --------------------------------------------------------------------

    def alloc_request(self) -> int:
        """Allocate a request row (>= 1) with no tokens.

        Raises:
            CacheFullError: all ``max_reqs - 1`` usable rows are in use.
        """
        if not self._free_rows:
            raise CacheFullError(
                f"no free request row: all {self.max_reqs - 1} usable rows are in use "
                f"(max_reqs={self.max_reqs}, row 0 reserved)"
            )
        row = self._free_rows.pop()
        self._row_slots[row] = []
        return row

    def alloc_slots(self, n: int) -> torch.Tensor:
        """Allocate ``n`` KV slots (not yet assigned to any request).

        Returns:
            ``[n]`` int64 slot ids (>= 1) on the cache's device.

        Raises:
            ValueError: ``n < 0``.
            CacheFullError: fewer than ``n`` slots are free.
        """
        if n < 0:
            raise ValueError(f"alloc_slots(n={n}): n must be >= 0")
        if n > len(self._free_slots):
            raise CacheFullError(
                f"KV cache full: asked for {n} slots, {len(self._free_slots)} free of "
                f"{self.num_slots - 1} usable (num_slots={self.num_slots}, slot 0 reserved)"
            )
        taken = self._free_slots[len(self._free_slots) - n :][::-1]
        del self._free_slots[len(self._free_slots) - n :]
        return torch.tensor(taken, dtype=torch.int64, device=self.device)

    def append_tokens(self, rows: Sequence[int], per_row: int) -> List[int]:
        """Allocate ``per_row`` slots for each of ``rows`` and append them to the rows, with
        one write of ``req_to_token`` for the whole batch (no device read; what a decode
        or speculative step needs per round without a host-device round trip per request).

        Returns:
            The slot ids, request-major (``per_row`` per row, in ``rows`` order), on the host.

        Raises:
            KeyError: a row is not allocated.
            CacheFullError: out of slots, or a row would exceed ``max_context_len``
                (nothing is allocated then).
        """
        index, taken = self.reserve_tokens(rows, per_row)
        if taken:
            packed = torch.tensor([index, taken], dtype=torch.int64).to(self.device)
            self.write_table(packed[0], packed[1])
        return taken

    def reserve_tokens(self, rows: Sequence[int], per_row: int) -> Tuple[List[int], List[int]]:
        """:meth:`append_tokens`'s host bookkeeping without its table write: the caller writes
        the table (:meth:`write_table`) from the returned lists, so a step that uploads
        its batch fields anyway sends the table's indices in the same host-to-device copy.

        Returns:
            ``(table index, slot ids)``: two host lists of ``per_row * len(rows)`` ints,
            request-major; the index is flat, ``row * max_context_len + position``.

        Raises:
            KeyError: a row is not allocated.
            CacheFullError: out of slots, or a row would exceed ``max_context_len``
                (nothing is allocated then).
        """
        owned = [self._live(r) for r in rows]
        for r, o in zip(rows, owned):
            if len(o) + per_row > self.max_context_len:
                raise CacheFullError(
                    f"request row {r} would hold {len(o) + per_row} tokens, more than max_context_len={self.max_context_len}"
                )
        n = per_row * len(rows)
        if n > len(self._free_slots):
            raise CacheFullError(
                f"KV cache full: asked for {n} slots, {len(self._free_slots)} free of "
                f"{self.num_slots - 1} usable (num_slots={self.num_slots}, slot 0 reserved)"
            )
        taken = self._free_slots[len(self._free_slots) - n :][::-1]
        del self._free_slots[len(self._free_slots) - n :]
        index: List[int] = []
        for i, (r, o) in enumerate(zip(rows, owned)):
            start = int(r) * self.max_context_len + len(o)
            o.extend(taken[i * per_row : (i + 1) * per_row])
            index.extend(range(start, start + per_row))
        return index, taken

    def write_table(self, index: torch.Tensor, slots: torch.Tensor) -> None:
        """``req_to_token.view(-1)[index[i]] = slots[i]`` in one device write (the table half
        of :meth:`reserve_tokens`; ``index_copy_`` costs the host less than a 2-D
        ``index_put_``); ``index``, ``slots``: ``[n]`` int64 on the cache's device."""
        self._flat_table.index_copy_(0, index, slots)

    def assign_slots(self, row: int, slots: Union[torch.Tensor, Sequence[int]]) -> None:
        """Append ``slots`` to request ``row``: positions ``request_len(row) ...`` map to them.

        Writes ``req_to_token[row, start:start + n]`` in place; ``row`` then owns the
        slots and :meth:`free_request` frees them.

        Raises:
            KeyError: ``row`` is not allocated.
            CacheFullError: the request would exceed ``max_context_len``.
        """
        owned = self._live(row)
        ids = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        start, end = len(owned), len(owned) + len(ids)
        if end > self.max_context_len:
            raise CacheFullError(
                f"request row {row} would hold {end} tokens, more than max_context_len={self.max_context_len}"
            )
        if ids:
            self.req_to_token[row, start:end] = torch.as_tensor(ids, dtype=torch.int64).to(self.device)
        owned.extend(ids)

    def truncate_request(self, row: int, length: int, *, clear: bool = True) -> None:
        """Shrink request ``row`` to ``length`` tokens, freeing the slots past it
        (rejected draft tokens after a TARGET_VERIFY step, for example).

        Args:
            clear: zero the table entries past ``length`` (one device write per call).
                ``False`` leaves them holding the freed slot ids, which nothing reads:
                attention reads a row up to its ``seq_lens`` (masking the rest), the row's
                next :meth:`append_tokens` overwrites those it reaches and
                :meth:`free_request` zeroes the row. A speculative loop that truncates
                every request every round skips those writes.

        Raises:
            KeyError: ``row`` is not allocated.
            ValueError: ``length`` is negative or longer than the request.
        """
        owned = self._live(row)
        if not 0 <= length <= len(owned):
            raise ValueError(f"truncate_request(row={row}, length={length}): request holds {len(owned)} tokens")
        dropped = owned[length:]
        del owned[length:]
        if clear and dropped:
            self.req_to_token[row, length : length + len(dropped)] = 0
        self._free_slots.extend(reversed(dropped))

    def free_slots(self, slots: Union[torch.Tensor, Sequence[int]]) -> None:
        """Return slots that were allocated but never assigned to a request.

        Raises:
            ValueError: a slot is 0 (reserved), out of range, or already free.
        """
        ids = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        free = set(self._free_slots)
        for s in ids:
            if not 0 < s < self.num_slots or s in free:
                raise ValueError(
                    f"cannot free slot {s}: reserved, out of range (num_slots={self.num_slots}) or already free"
                )
            free.add(s)
        self._free_slots.extend(reversed(ids))

    def free_request(self, row: int) -> None:
        """Free request ``row`` and every slot assigned to it; its table row is zeroed.

        Raises:
            KeyError: ``row`` is 0 or not allocated.
        """
        self.truncate_request(row, 0)  # validates the row, frees its slots, zeroes it
        del self._row_slots[int(row)]
        self._free_rows.append(row)

    def reset(self) -> None:
        """Free every request and slot (buffers keep their addresses)."""
        for row in list(self._row_slots):
            self.free_request(row)

    def _live(self, row: int) -> List[int]:
        try:
            return self._row_slots[int(row)]
        except KeyError:
            raise KeyError(
                f"request row {row} is not allocated (row 0 is the reserved dummy; allocated: {sorted(self._row_slots)})"
            ) from None

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"slots={self.num_slots} ({self.num_free_slots} free), reqs={self.max_reqs} ({self.num_free_requests} free), "
            f"max_context_len={self.max_context_len}, dtype={self.dtype}, device={self.device})"
        )
