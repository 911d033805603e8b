"""``ForwardBatch``: the one object a runner hands to a model's forward.

The field names follow sglang's ``ForwardBatch`` (``input_ids``, ``positions``,
``out_cache_loc``, ``req_pool_indices``, ``seq_lens``, ``extend_*``) so engine
authors recognise them. Only what a paged-KV decoder needs is here; an engine can
carry more in ``extra``.

Conventions shared by the runners and the reference model:

* Token-axis tensors have ``num_tokens`` rows, request-axis tensors ``batch_size``.
* KV-cache slot 0 and request row 0 are reserved dummies: padded tokens write their
  K/V into slot 0 and padded requests read row 0, so padding never touches live data
  (sglang's convention).
* ``seq_lens`` is the KV length *after* this step's tokens are written.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Dict, List, Optional

import torch

from .host_guard import HOST_FIELDS, GuardedExtra, check_host_read, guard_engaged


class ForwardMode(enum.Enum):
    """What a batch does.

    * ``DECODE``: one new token per request.
    * ``TARGET_VERIFY``: speculative verification, ``num_tokens_per_req`` (> 1) new
      tokens per request, every request the same width.
    * ``EXTEND``: prefill; each request appends ``extend_seq_lens[i]`` tokens after a
      cached prefix of ``extend_prefix_lens[i]`` tokens (chunked prefill when > 0).
    * ``DLLM_EXTEND``: a diffusion LLM's denoising step (sglang's ``DLLM_EXTEND``): every
      request carries a block of ``num_tokens_per_req`` tokens (the same fixed width for
      all) at the end of its sequence; attention is bidirectional inside the block and
      causal to the cached prefix. Like TARGET_VERIFY it has a fixed width per request,
      so the decode runner keys it by batch size.
    """

    DECODE = "decode"
    TARGET_VERIFY = "target_verify"
    EXTEND = "extend"
    DLLM_EXTEND = "dllm_extend"

    def is_decode_like(self) -> bool:
        """True for the fixed-width modes the decode runner keys by batch size
        (DECODE, TARGET_VERIFY, DLLM_EXTEND)."""
        return self in _DECODE_LIKE

    def is_block_bidirectional(self) -> bool:
        """True where the new tokens of a request see each other both ways (DLLM_EXTEND)."""
        return self is ForwardMode.DLLM_EXTEND


_DECODE_LIKE = frozenset((ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DLLM_EXTEND))


@dataclasses.dataclass
class ForwardBatch:
    """A batch of requests for one forward step.

    Attributes:
        forward_mode: see :class:`ForwardMode`.
        input_ids: ``[num_tokens]`` int64 token ids.
        positions: ``[num_tokens]`` int64 position of each token in its request.
        out_cache_loc: ``[num_tokens]`` int64 KV-cache slot each token's K/V is written to.
        req_pool_indices: ``[batch_size]`` int64 row of each request in the
            request-to-token table of the KV cache.
        seq_lens: ``[batch_size]`` int32 KV length of each request after this step.
        extend_seq_lens: ``[batch_size]`` int32 new tokens per request (EXTEND only).
        extend_prefix_lens: ``[batch_size]`` int32 cached prefix per request (EXTEND only).
        seq_lens_cpu, extend_seq_lens_cpu, extend_prefix_lens_cpu: host copies of the
            same values, for eager code that loops over requests (never read inside a
            captured graph: they would be frozen at capture; the runner's
            :class:`StaticForwardBatch` makes such a read an error).
        num_tokens_per_req: tokens per request in DECODE (1), TARGET_VERIFY (> 1) and
            DLLM_EXTEND (the block width, >= 1).
        extra: engine-specific fields; runners copy none of it, except the model-owned
            static inputs the model declares (:mod:`cuda_graph_runner.runner.static_inputs`),
            which the runner copies into its own buffers. Host values in it (Python
            numbers, lists, tuples, numpy arrays, tensors on another device) are guarded
            like the ``*_cpu`` fields (:mod:`cuda_graph_runner.backend.host_guard`).
        graph_variant: the variant label of the graph this batch is captured or replayed
            in (:mod:`cuda_graph_runner.runner.variants`; ``""``: none). The runner sets
            it on its static batches; a model reads it to pick the code it records (the
            reference model skips its LoRA adapters under ``"nolora"``). A live batch
            leaves it ``""`` and the model decides on its own (eager path).
    """

    forward_mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_seq_lens: Optional[torch.Tensor] = None
    extend_prefix_lens: Optional[torch.Tensor] = None
    seq_lens_cpu: Optional[List[int]] = None
    extend_seq_lens_cpu: Optional[List[int]] = None
    extend_prefix_lens_cpu: Optional[List[int]] = None
    num_tokens_per_req: int = 1
    extra: Dict[str, Any] = dataclasses.field(default_factory=dict)
    graph_variant: str = ""

    @property
    def batch_size(self) -> int:
        """Number of requests."""
        return int(self.req_pool_indices.shape[0])

    @property
    def num_tokens(self) -> int:
        """Number of tokens over all requests."""
        return int(self.input_ids.shape[0])

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def replace(self, **changes: Any) -> "ForwardBatch":
        """A shallow copy with some fields replaced (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


class StaticForwardBatch(ForwardBatch):
    """The batch a runner hands to capture and replay: a :class:`ForwardBatch` whose host
    fields (``seq_lens_cpu``, ``extend_seq_lens_cpu``, ``extend_prefix_lens_cpu`` and host
    values in ``extra``) are guarded properties.

    Outside a guard (eager runs, replay, the metadata hooks) a read costs one thread-local
    lookup and returns the value. While the runner records a graph, a read where the
    backend would freeze it raises
    :class:`~cuda_graph_runner.backend.errors.CudaGraphHostValueError` (see
    :mod:`cuda_graph_runner.backend.host_guard` for the rule per backend). ``repr`` and
    :meth:`replace` never count as reads.
    """

    def replace(self, **changes: Any) -> "StaticForwardBatch":
        """A shallow copy with some fields replaced, without reading guarded fields."""
        values = {f.name: _stored(self, f.name) for f in dataclasses.fields(self) if f.init}
        values.update(changes)
        return type(self)(**values)

    def __repr__(self) -> str:
        inner = ", ".join(f"{f.name}={_stored(self, f.name)!r}" for f in dataclasses.fields(self) if f.repr)
        return f"{type(self).__name__}({inner})"


def _storage_key(name: str) -> str:
    # Guarded values live under another key than the property's name: Dynamo (torch 2.11)
    # resolves ``self.__dict__[name]`` back through the property and recurses forever.
    return "_guarded_" + name


def _stored(batch: ForwardBatch, name: str) -> Any:
    """The value of field ``name`` without a guarded read (for repr, replace, copies)."""
    data = batch.__dict__
    key = _storage_key(name)
    return data[key] if key in data else data.get(name)


def _guarded_field(name: str) -> property:
    key = _storage_key(name)

    def get(self: ForwardBatch) -> Any:
        check_host_read(name)
        return self.__dict__[key]

    def set_(self: ForwardBatch, value: Any) -> None:
        self.__dict__[key] = value

    return property(get, set_, doc=f"Host field ``{name}`` (guarded during capture).")


def _get_extra(self: ForwardBatch) -> Dict[str, Any]:
    data = self.__dict__[_storage_key("extra")]
    if guard_engaged():
        return GuardedExtra(data, self.__dict__["input_ids"].device)  # type: ignore[return-value]
    return data


def _set_extra(self: ForwardBatch, value: Dict[str, Any]) -> None:
    self.__dict__[_storage_key("extra")] = value


for _name in HOST_FIELDS:
    setattr(StaticForwardBatch, _name, _guarded_field(_name))
StaticForwardBatch.extra = property(
    _get_extra,
    _set_extra,  # type: ignore[assignment]
    doc="Engine fields; host values in it are guarded during capture.",
)
del _name


def as_static_batch(batch: ForwardBatch, **changes: Any) -> StaticForwardBatch:
    """``batch`` as a :class:`StaticForwardBatch` (shallow: tensors and lists are shared),
    with ``changes`` applied; a static batch without changes is returned as is."""
    if isinstance(batch, StaticForwardBatch):
        return batch.replace(**changes) if changes else batch
    values = {f.name: _stored(batch, f.name) for f in dataclasses.fields(batch) if f.init}
    values.update(changes)
    return StaticForwardBatch(**values)


#: Per source class: ``(source __dict__ key, static __dict__ key, field name)`` of every
#: ``ForwardBatch`` init field (guarded fields live under their storage keys).
_FIELD_KEYS: Dict[type, tuple] = {}


def _field_keys(cls: type) -> tuple:
    keys = _FIELD_KEYS.get(cls)
    if keys is None:
        guarded = set(HOST_FIELDS) | {"extra"}
        source_static = issubclass(cls, StaticForwardBatch)
        keys = _FIELD_KEYS[cls] = tuple(
            (
                _storage_key(f.name) if source_static and f.name in guarded else f.name,
                _storage_key(f.name) if f.name in guarded else f.name,
                f.name,
            )
            for f in dataclasses.fields(ForwardBatch)
            if f.init
        )
    return keys


class StaticBatchUpdater:
    """Refreshes one reused :class:`StaticForwardBatch` from each live batch, keeping some
    fields (the runner's buffer views) as they are: what ``as_static_batch(batch, **views)``
    gives, without building a new object per step (a dict write per field, no property
    calls, no guarded reads).

    Args:
        static: the batch to refresh (its kept fields are set once, by the caller).
        keep: field names left untouched (e.g. ``{"input_ids", "positions", "out_cache_loc"}``).
    """

    def __init__(self, static: StaticForwardBatch, keep: "set[str] | frozenset[str]") -> None:
        self.static = static
        self.keep = frozenset(keep)
        self._plans: Dict[type, tuple] = {}

    def __call__(self, batch: ForwardBatch) -> StaticForwardBatch:
        """``static`` with every field but the kept ones taken from ``batch`` (shallow)."""
        cls = type(batch)
        plan = self._plans.get(cls)
        if plan is None:
            plan = self._plans[cls] = tuple((src, dst) for src, dst, name in _field_keys(cls) if name not in self.keep)
        src_dict = batch.__dict__
        dst_dict = self.static.__dict__
        for src, dst in plan:
            dst_dict[dst] = src_dict[src]
        return self.static


def last_token_rows(hidden: torch.Tensor, extend_seq_lens: torch.Tensor) -> torch.Tensor:
    """Each request's last new token of an EXTEND batch: ``hidden`` ``[num_tokens, ...]``
    (requests' tokens back to back) to ``[batch_size, ...]``, what a prefill's LM head
    reads. A request of no new tokens (a zero-length sentinel that pads a prefill graph's
    request slots) gets a row of zeros, never its neighbour's last row. Device-side only
    (no host sync), so a captured forward may call it.

    Args:
        hidden: ``[num_tokens, ...]`` any dtype.
        extend_seq_lens: ``[batch_size]`` integer, new tokens per request.
    """
    lens = extend_seq_lens.to(torch.int64)
    last = torch.cumsum(lens, dim=0) - 1
    rows = hidden[last.clamp(min=0)]  # an empty request's index is its neighbour's (or -1)
    keep = (lens > 0).view(-1, *([1] * (rows.dim() - 1)))
    return torch.where(keep, rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
