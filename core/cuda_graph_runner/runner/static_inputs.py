"""Model-owned static inputs: buffers a model (or its attention backend) declares and the
runner allocates, fills from each live batch and pads like its own slots.

A captured graph reads its inputs from fixed addresses. The runner's own slots
(``input_ids``, ``positions``, ...) cover what every model reads; a model that reads
more per request or per token (a LoRA adapter index per request, a per-token
mask, a rope offset) declares it with :class:`StaticInput` from an optional protocol
method::

    class MyModel:
        def static_inputs(self) -> Sequence[StaticInput]:
            return [StaticInput("lora_adapter_ids", axis="batch", dtype=torch.int64, pad_value=-1)]

The runner then

* allocates one buffer per input (``[max rows, *trailing_shape]``, filled with
  ``pad_value``) once, next to its own slots;
* at capture, puts a view of each buffer (the captured size's rows) into the static
  batch's ``extra[name]``: the model reads ``batch.extra[name]`` and the graph records
  that address;
* at replay, copies the live batch's ``extra[name]`` (a tensor of ``rows`` rows, or a
  host list / tuple of numbers, converted on the way) into the buffer and pads the rest
  of the captured rows with ``pad_value``; a live batch without ``extra[name]`` (or with
  None) gets ``pad_value`` in every row. The live batch's other ``extra`` entries are
  passed through by reference.

Idea: sglang's attention backends own static metadata buffers that they fill in
``init_forward_metadata_replay_cuda_graph``; its LoRA manager keeps per-request adapter
indices in persistent tensors (``lora_manager.cuda_graph_batch_info``) that each replay
refreshes. Here the runner owns the buffers, so padding follows one rule for everything.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..backend.buffers import BATCH_AXIS, TOKEN_AXIS, CudaGraphBufferRegistry, accepted_source_dtypes, dtype_mismatch

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclasses.dataclass(frozen=True)
class StaticInput:
    """One model-owned static input.

    Attributes:
        name: the key in ``ForwardBatch.extra`` (an identifier; must not clash with the
            runner's own slots ``input_ids``, ``positions``, ``out_cache_loc``,
            ``req_pool_indices``, ``seq_lens``).
        axis: ``"batch"`` (one row per request) or ``"token"`` (one row per token).
        dtype: the buffer's dtype; a live value of another dtype is cast on copy.
        pad_value: what padded rows (and rows of a batch that gives no value) hold.
        trailing_shape: dimensions after the row axis (``()``: one value per row).

    Raises:
        ValueError: a bad name or axis, or a negative trailing dimension.
        TypeError: ``dtype`` is not a ``torch.dtype``.
    """

    name: str
    axis: str
    dtype: torch.dtype
    pad_value: float = 0
    trailing_shape: Tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(f"StaticInput name={self.name!r}: must be an identifier (letters, digits, _)")
        if self.axis not in (BATCH_AXIS, TOKEN_AXIS):
            raise ValueError(f"StaticInput {self.name!r}: axis={self.axis!r}; accepted: {BATCH_AXIS!r}, {TOKEN_AXIS!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"StaticInput {self.name!r}: dtype={self.dtype!r} is not a torch.dtype")
        shape = tuple(self.trailing_shape)
        if any(not isinstance(d, int) or d < 0 for d in shape):
            raise ValueError(f"StaticInput {self.name!r}: trailing_shape={self.trailing_shape!r} must be ints >= 0")
        object.__setattr__(self, "trailing_shape", shape)


def declared_static_inputs(model: Any, reserved: Sequence[str] = ()) -> List[StaticInput]:
    """The static inputs ``model.static_inputs()`` declares (``[]`` without the method).

    Raises:
        TypeError: the method returns something else than a sequence of :class:`StaticInput`.
        ValueError: a name is declared twice or clashes with one of ``reserved`` (the
            runner's own slots).
    """
    method = getattr(model, "static_inputs", None)
    if method is None:
        return []
    specs = method()
    if specs is None:
        return []
    if isinstance(specs, (str, bytes)) or not isinstance(specs, Sequence):
        raise TypeError(f"{type(model).__name__}.static_inputs() returned {specs!r}; expected a list of StaticInput")
    seen: Dict[str, StaticInput] = {}
    for spec in specs:
        if not isinstance(spec, StaticInput):
            raise TypeError(
                f"{type(model).__name__}.static_inputs() returned {spec!r} ({type(spec).__name__}); "
                "expected cuda_graph_runner.runner.static_inputs.StaticInput"
            )
        if spec.name in seen or spec.name in reserved:
            what = "declared twice" if spec.name in seen else "the name of one of the runner's own slots"
            raise ValueError(
                f"{type(model).__name__}.static_inputs(): {spec.name!r} is {what}; reserved: {list(reserved)}"
            )
        seen[spec.name] = spec
    return list(seen.values())


class ModelStaticInputs:
    """The model-owned inputs of one runner: registers their buffers and fills them.

    Args:
        specs: what the model declared (:func:`declared_static_inputs`).
        buffers: the runner's buffer registry (the inputs get slots there, so
            ``buffers.reset()`` and ``buffers.nbytes()`` cover them).
        max_requests: the largest captured batch size.
        tokens_per_request: token-axis rows per request (the decode runner's width).
    """

    def __init__(
        self,
        specs: Sequence[StaticInput],
        buffers: CudaGraphBufferRegistry,
        max_requests: int,
        tokens_per_request: int = 1,
    ) -> None:
        self.specs = tuple(specs)
        self.buffers = buffers
        self.width = int(tokens_per_request)
        for spec in self.specs:
            buffers.register(
                spec.name,
                axis=spec.axis,
                rows=max_requests * self._per_request(spec),
                dtype=spec.dtype,
                pad_value=spec.pad_value,
                trailing_shape=spec.trailing_shape,
            )

    def __bool__(self) -> bool:
        return bool(self.specs)

    def _per_request(self, spec: StaticInput) -> int:
        return self.width if spec.axis == TOKEN_AXIS else 1

    def views(self, requests: int) -> Dict[str, torch.Tensor]:
        """``{name: buffer[:rows]}`` for a batch of ``requests`` requests (capture and replay
        read these addresses)."""
        return {s.name: self.buffers.view(s.name, requests * self._per_request(s)) for s in self.specs}

    def fill(self, extra: Mapping[str, Any], live_requests: int, padded_requests: int) -> None:
        """Copy each input from a live batch's ``extra`` into its buffer, padded.

        Args:
            extra: the live batch's ``extra``; ``extra[name]`` is a tensor of the live
                rows (``[rows, *trailing_shape]``), a host list/tuple of numbers, or
                absent / None (every row gets ``pad_value``).
            live_requests: the live batch's requests.
            padded_requests: the captured size it replays in.

        Raises:
            ValueError: a value with another number of rows or another trailing shape
                than the input needs (names the input, both shapes), or of another dtype
                kind than the input's (float values for an integer input; names both
                dtypes): the copy would cast it silently.
            TypeError: a value that is neither a tensor, a list/tuple nor None.
        """
        buffers = self.buffers
        for spec in self.specs:
            per = self._per_request(spec)
            rows, padded = live_requests * per, padded_requests * per
            value = extra.get(spec.name)
            if value is None:
                slot = buffers.slot(spec.name)
                slot.tensor[:padded].fill_(spec.pad_value)
                if slot.dirty <= padded:  # rows past ``padded`` an earlier batch wrote stay dirty
                    slot.dirty = 0
                continue
            src = self._as_tensor(spec, value)
            if src.dtype not in accepted_source_dtypes(spec.dtype):
                raise dtype_mismatch(spec.name, src, spec.dtype, f"static input {spec.name!r}: extra[{spec.name!r}]")
            want = (rows, *spec.trailing_shape)
            if tuple(src.shape) != want:
                raise ValueError(
                    f"static input {spec.name!r}: the batch's extra[{spec.name!r}] has shape {tuple(src.shape)}, "
                    f"expected {want} ({spec.axis} axis, {live_requests} requests)"
                )
            buffers.fill(spec.name, src, padded)

    def _as_tensor(self, spec: StaticInput, value: Any) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)):
            # A host list: one small host-to-device copy (sglang builds its LoRA indices so).
            # Its own dtype first: floats for an integer input would be truncated silently.
            host = torch.tensor(value)
            if host.numel() and host.dtype not in accepted_source_dtypes(spec.dtype):
                if not (spec.dtype.is_floating_point and host.dtype is torch.int64):  # Python ints: exact
                    raise dtype_mismatch(
                        spec.name, host, spec.dtype, f"static input {spec.name!r}: the host list extra[{spec.name!r}]"
                    )
            return host.to(self.buffers.device, dtype=spec.dtype, non_blocking=True)
        raise TypeError(
            f"static input {spec.name!r}: extra[{spec.name!r}] is a {type(value).__name__}; "
            "accepted: a tensor, a list or tuple of numbers, or None"
        )

    def static_extra(self, extra: Optional[Mapping[str, Any]], requests: int) -> Dict[str, Any]:
        """A new ``extra`` dict: ``extra``'s entries with each input replaced by its buffer view."""
        out = dict(extra) if extra else {}
        out.update(self.views(requests))
        return out
