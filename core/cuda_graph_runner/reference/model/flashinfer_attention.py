"""``flashinfer`` / ``flashinfer_tc``: the reference model's attention through FlashInfer's
paged wrappers, driven as sglang's FlashInfer backend drives them
(``python/sglang/srt/layers/attention/flashinfer_backend.py``).

The reference KV cache holds one slot per token and a ``req_to_token`` table, so the
wrappers run with ``page_size=1`` and the slot ids as page indices (as sglang does):
request ``i``'s pages are ``req_to_token[req_pool_indices[i], :kv_len_i]``, its
``last_page_len`` is 1, and ``indptr`` is the running sum of the KV lengths.

* DECODE: one ``BatchDecodeWithPagedKVCacheWrapper(use_cuda_graph=True,
  paged_kv_indptr_buffer=..., paged_kv_indices_buffer=..., paged_kv_last_page_len_buffer=...)``
  per captured graph key (:func:`~.attention_backend.graph_key`), built once per key and
  planned by the capture hook; before every replay the replay hook writes the page ids
  on the device into the wrapper's index buffer and re-plans it on the host from the
  padded host lengths (``indptr`` from ``seq_lens_cpu``: no device-to-host copy). Eager
  forwards use one wrapper without graph buffers, planned by the eager metadata hook.
  ``flashinfer_tc`` is the same with ``use_tensor_cores=True`` (FlashInfer's prefill
  kernels run the decode step: faster for large GQA groups).
* EXTEND: one ``BatchPrefillWithPagedKVCacheWrapper`` (causal, cached prefixes, ragged
  requests, the model's sliding window) planned from ``extend_seq_lens_cpu`` /
  ``extend_prefix_lens_cpu``; not capture-safe (the marked op declares only decode), so
  a prefill graph breaks at it and the op runs it eagerly with the plan of the hook.
* TARGET_VERIFY / DLLM_EXTEND (several query tokens per request) are refused with a
  clear error: this backend does not plan them.

Geometry (heads, head_dim, dtype) reaches the backend with the first layer's call, so a
hook that runs before any forward records its host lengths and the first layer of the
next forward (an eager forward, or a capture's warm-up, which runs outside the graph)
plans them; every later hook plans at once. The ``req_to_token`` table the hooks index
is the model's current cache's: the model tells the backend of every cache it attaches
(:meth:`FlashInferAttention.attach_kv_cache`), as a hook runs before the forward's layers
pass the table (a table of the previous cache would be indexed with the new batch's rows
and lengths: out of range on CUDA is a device-side assert). A forward recorded into a
graph with no plan raises instead of recording stale buffers.

FlashInfer's ``plan()`` fills a pinned host buffer and copies it to the device with an
asynchronous copy, and re-planning the same wrapper overwrites that buffer: the backend
keeps a ring of two pinned buffers and an event per buffer, and a plan first waits for the
copy that last read its buffer (:class:`PinnedPlanRing`, shared by the backend's
wrappers; in steady state that copy ran two steps ago, so it never waits). The event is
recorded after every plan, one that raised included (its copy may already be enqueued).

A plan's device buffers (page ids, indptr, the wrapper's int workspace) are written on
the stream that planned, and freed to that stream's allocator when the next plan replaces
them; so the eager wrappers (extend, eager decode) run only with a plan made on the stream
they run on: a run on another stream (a capture's eager breaks run on the capture stream,
the hooks on the caller's) plans again there first. The plan of the extend wrapper is
keyed by what it depends on: the batch, its host lengths, the ``req_to_token`` table by
storage (address, shape, strides: a backend may pass a non-owning alias of the same table,
as breakable does for an eager break's arguments) and the request rows' tensor.

FlashInfer has no float32 kernels: a float32 model is refused (ValueError naming the
dtypes it takes). Needs ``flashinfer-python`` (``pip install 'cuda-graph-runner[flashinfer]'``),
imported when the backend is built (:func:`make_flashinfer_attention`), and CUDA tensors.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib.util
import itertools
import weakref
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ...backend.context import get_forward_batch
from ...backend.forward_batch import ForwardBatch, ForwardMode, StaticForwardBatch, _stored
from ...backend.graph_break import eager_op
from ...config.exceptions import CudaGraphRunnerError
from .attention import AttentionCall
from .attention_backend import AttentionBackend, graph_key

#: Bytes of the float workspace shared by every wrapper of one backend (split-KV partials;
#: FlashInfer recommends 128 MiB).
WORKSPACE_BYTES = 128 * 1024 * 1024
#: The dtypes FlashInfer's attention kernels take.
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
#: The head dims FlashInfer's attention kernels are generated for.
SUPPORTED_HEAD_DIMS = (64, 128, 256)
#: Entries of :attr:`FlashInferAttention.plan_log` kept (the oldest are dropped past it:
#: one plan per replay would otherwise grow without bound).
PLAN_LOG_SIZE = 1024

_instances: "weakref.WeakValueDictionary[int, FlashInferAttention]" = weakref.WeakValueDictionary()
_ids = itertools.count(1)


def flashinfer_available() -> bool:
    """True when the ``flashinfer`` package can be imported (it is not imported here)."""
    return importlib.util.find_spec("flashinfer") is not None


def _flashinfer() -> Any:
    import flashinfer  # lazy: optional, and its import is slow

    return flashinfer


class FlashInferPlanError(CudaGraphRunnerError, RuntimeError):
    """A FlashInfer forward without a plan made for it (see the module docstring)."""


@dataclasses.dataclass(frozen=True)
class Geometry:
    """What a plan needs besides the lengths, from the first layer's call."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    window_left: int  # FlashInfer's inclusive left window: sliding_window - 1, or -1 (off)
    scaling: float


class PinnedPlanRing:
    """Two pinned host buffers that every wrapper's ``plan()`` of one backend fills in turn,
    each with the event recorded after the plan whose asynchronous copy reads it:
    :meth:`before_plan` waits for that event, then hands the buffer to the wrapper (its
    ``_pin_memory_int_workspace_buffer``). One ring per backend keeps pinned memory at two
    buffers however many sizes are captured (the wrappers' own buffers are released).
    :meth:`planning` brackets one plan and records the event even when the plan raises
    (its copy may be enqueued already), so a failed plan leaves no unguarded copy.

    Args:
        event_factory: ``() -> event`` with ``record()``, ``query()``, ``synchronize()``
            (``torch.cuda.Event`` on CUDA; tests pass fakes); one event per buffer, made
            once and re-recorded.
        size: buffers in the ring (>= 1).

    Attributes:
        waits: plans that found their buffer's copy still pending and waited for it.
    """

    def __init__(self, event_factory: Callable[[], Any], size: int = 2) -> None:
        self.event_factory = event_factory
        self.buffers: List[Optional[torch.Tensor]] = [None] * size
        self.events: List[Any] = [None] * size
        self.recorded: List[bool] = [False] * size
        self.index = size - 1
        self.waits = 0

    def before_plan(self, wrapper: Any) -> None:
        self.index = (self.index + 1) % len(self.buffers)
        event = self.events[self.index]
        if self.recorded[self.index] and not event.query():
            self.waits += 1
            event.synchronize()
        own = wrapper._pin_memory_int_workspace_buffer
        buffer = self.buffers[self.index]
        if buffer is None or buffer.numel() < own.numel():
            if buffer is None and own is not self.buffers[self.index - 1]:
                buffer = own  # the first wrapper's own buffer starts the ring
            else:
                pinned = torch.cuda.is_available() and own.is_pinned()
                buffer = torch.empty(own.shape, dtype=own.dtype, pin_memory=pinned)
            self.buffers[self.index] = buffer
        wrapper._pin_memory_int_workspace_buffer = buffer

    def after_plan(self) -> None:
        event = self.events[self.index]
        if event is None:
            event = self.events[self.index] = self.event_factory()
        event.record()
        self.recorded[self.index] = True

    @contextlib.contextmanager
    def planning(self, wrapper: Any) -> Iterator[None]:
        """``before_plan(wrapper)``, the block (the wrapper's ``plan()``), then
        ``after_plan()`` whether or not the block raised."""
        self.before_plan(wrapper)
        try:
            yield
        finally:
            self.after_plan()


def table_key(t: torch.Tensor) -> tuple:
    """What identifies a ``req_to_token`` table for a plan made from it: its storage
    address, shape and strides (two tensor objects viewing one table, e.g. a non-owning
    alias, give one key; a new table gives another). Never compares values (that would
    read the device)."""
    return (t.data_ptr(), tuple(t.shape), t.stride())


def _capturing() -> bool:
    """Whether the current CUDA stream is recording a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _stream_id() -> int:
    """The current CUDA stream's handle (0 without CUDA): the stream a plan's device
    buffers are written and freed on."""
    return torch.cuda.current_stream().cuda_stream if torch.cuda.is_available() else 0


@dataclasses.dataclass(eq=False)
class DecodeState:
    """Per-size state of a decode graph: the wrapper and the buffers its kernels read."""

    key: tuple
    batch_size: int
    wrapper: Any = None
    indptr: Optional[torch.Tensor] = None  # [bs + 1] int32
    indices: Optional[torch.Tensor] = None  # [bs * max_context_len] int32
    last_page_len: Optional[torch.Tensor] = None  # [bs] int32 ones
    planned: Optional[List[int]] = None  # the host lengths of the last plan
    pending: Optional[List[int]] = None  # host lengths of a hook that ran before geometry was known
    plans: int = 0


@eager_op("flashinfer_attention", capture_safe=("decode",))
@torch.compiler.disable  # its body calls FlashInfer's TVM-FFI functions, which Dynamo cannot trace
def flashinfer_attention(
    output: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    scaling: float,
    sliding_window: int,
    last_layer: bool,
    backend_id: int,
) -> None:
    """The ``flashinfer`` attention (arguments as ``reference_llama_attention``'s, plus the
    id of the backend instance). Capture-safe in DECODE together with the replay hook,
    which re-plans the recorded wrapper's buffers."""
    call = AttentionCall(output, q, k_cache, v_cache, req_to_token, scaling, sliding_window, get_forward_batch())
    _instances[backend_id]._run(call)


def _host_lens(values: Optional[Sequence[int]], what: str) -> List[int]:
    if values is None:
        raise ValueError(
            f"attention 'flashinfer' plans from the host lengths: the batch has {what}=None (give the "
            "ForwardBatch its host lists; a plan never reads device tensors, which would synchronize)"
        )
    return [int(x) for x in values]


def _pinned_ints(values: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A host tensor of ``values``, made in pinned memory at once where CUDA is: a
    host-to-device copy from it is truly asynchronous (from pageable memory the driver may
    wait for the stream), and the caching host allocator keeps the block until the copy ran."""
    return torch.tensor(values, dtype=dtype, pin_memory=torch.cuda.is_available())


def _indptr(lens: Sequence[int]) -> torch.Tensor:
    """``[len(lens) + 1]`` int32 host running sum, pinned (:func:`_pinned_ints`)."""
    return _pinned_ints([0, *itertools.accumulate(lens)], torch.int32)


_aranges: Dict[torch.device, torch.Tensor] = {}


def _arange(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)`` int64 on ``device``, a view of one kept tensor grown by doubling: one
    kernel less per plan."""
    kept = _aranges.get(device)
    if kept is None or kept.numel() < n:
        kept = _aranges[device] = torch.arange(
            max(n, 2 * (kept.numel() if kept is not None else 0), 1024), device=device
        )
    return kept[:n]


def write_page_ids(
    out: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, kv_lens: Sequence[int]
) -> int:
    """Write request ``i``'s page ids ``req_to_token[req_pool_indices[i], :kv_lens[i]]`` one
    request after another into ``out[:sum(kv_lens)]`` (int32), on ``out``'s device, with
    shapes from the host lengths only (no device-to-host read). Returns ``sum(kv_lens)``.

    The lengths and their running starts go to the device in one copy; then a few index
    kernels (sglang writes the same ids with one Triton kernel,
    ``create_flashinfer_kv_indices_triton``).

    Raises:
        ValueError: ``out`` holds fewer than ``sum(kv_lens)`` entries, or a length exceeds
            the table's width (checked on the host: on CUDA an index past the row would
            be a device-side assert, e.g. lengths meant for another cache's table).
    """
    lens = [int(n) for n in kv_lens]
    n = len(lens)
    starts = [0, *itertools.accumulate(lens)]
    total = starts[-1]
    if total > out.numel():
        raise ValueError(f"page-id buffer of {out.numel()} entries cannot hold {total} page ids")
    width = req_to_token.shape[1]
    if lens and max(lens) > width:
        i = max(range(n), key=lens.__getitem__)
        raise ValueError(
            f"request {i} has {lens[i]} KV tokens, more than the {width} columns of the req_to_token table "
            f"{tuple(req_to_token.shape)} (a table of another KV cache?); accepted: lengths up to {width}"
        )
    device = out.device
    meta = _pinned_ints(lens + starts[:-1], torch.int64).to(device, non_blocking=True)
    req = torch.repeat_interleave(meta[:n], output_size=total)  # request i, lens[i] times: no sync
    col = _arange(total, device) - meta[n:][req]
    rows = req_pool_indices.to(torch.int64)[req]
    out[:total].copy_(req_to_token[rows, col])  # the copy casts to int32
    return total


class FlashInferAttention(AttentionBackend):
    """``flashinfer`` (``use_tensor_cores=False``) and ``flashinfer_tc`` (True): see the module docstring.

    Args:
        use_tensor_cores: FlashInfer's tensor-core decode variant.
        workspace_bytes: size of the shared float workspace.
        event_factory: the event type of :class:`PinnedPlanRing` (default ``torch.cuda.Event``).

    Attributes:
        states: per-size decode state by graph key.
        state_builds: how often each key's wrapper was built (1 per key between cleanups).
        geometry: learned from the first layer's call (None before).
        plan_log: ``(wrapper kind, graph key or None, host kv lengths)`` per plan, oldest
            first (the latest :data:`PLAN_LOG_SIZE`).

    Raises (at a forward or a plan):
        ValueError: a float32 (or other unsupported) dtype, names the accepted ones; a
            batch without its host lengths.
        NotImplementedError: TARGET_VERIFY / DLLM_EXTEND batches.
        FlashInferPlanError: a graph forward recorded with no plan, or a replay of a
            graph whose state was never built or was dropped by cleanup.
    """

    name = "flashinfer"
    plans = True

    def __init__(
        self,
        use_tensor_cores: bool = False,
        workspace_bytes: int = WORKSPACE_BYTES,
        event_factory: Optional[Callable[[], Any]] = None,
    ) -> None:
        self.id = next(_ids)
        _instances[self.id] = self
        self.use_tensor_cores = use_tensor_cores
        if use_tensor_cores:
            self.name = "flashinfer_tc"  # type: ignore[misc]
        self.workspace_bytes = workspace_bytes
        self.event_factory = event_factory
        self.geometry: Optional[Geometry] = None
        self.req_to_token: Optional[torch.Tensor] = None
        self.states: Dict[tuple, DecodeState] = {}
        self.state_builds: Dict[tuple, int] = {}
        self.plan_log: Deque[Tuple[str, Optional[tuple], List[int]]] = collections.deque(maxlen=PLAN_LOG_SIZE)
        self._workspace: Optional[torch.Tensor] = None
        self._eager_decode: Optional[DecodeState] = None
        self._prefill: Any = None
        self.pinned_ring = PinnedPlanRing(event_factory or torch.cuda.Event)
        # Per wrapper: the event recorded after its latest eager run, and that run's stream.
        self._runs: "weakref.WeakKeyDictionary[Any, Tuple[Any, int]]" = weakref.WeakKeyDictionary()
        self._last_page_lens: Dict[int, torch.Tensor] = {}
        # What the eager decode / prefill wrappers were last planned for: (batch ref, lengths,
        # table_key of req_to_token, stream id) / (batch ref, _prefill_key(...)).
        self._eager_plan: Optional[Tuple[Any, tuple, tuple, int]] = None
        self._prefill_plan: Optional[Tuple[Any, tuple]] = None
        self._eager_pending: Optional[Tuple[Any, tuple]] = None

    # -- setup -------------------------------------------------------------------------
    def _learn(self, call: AttentionCall) -> Geometry:
        d = call.k_cache.shape[-1]
        dtype = call.q.dtype
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"attention {self.name!r} has no {dtype} kernels; FlashInfer takes "
                f"{', '.join(str(t) for t in SUPPORTED_DTYPES)}: build the model in one of them, "
                "or use attention 'torch'"
            )
        if d not in SUPPORTED_HEAD_DIMS:
            raise ValueError(
                f"attention {self.name!r}: head_dim={d} has no FlashInfer kernels; accepted: "
                f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))} (use attention 'torch' for this model)"
            )
        if call.q.device.type != "cuda" and self.event_factory is None:
            raise RuntimeError(
                f"attention {self.name!r} runs on CUDA tensors; got tensors on {call.q.device}: use attention 'torch'"
            )
        geometry = Geometry(
            call.q.shape[1] // d,
            call.k_cache.shape[1],
            d,
            dtype,
            call.q.device,
            call.sliding_window - 1 if call.sliding_window > 0 else -1,
            float(call.scaling),
        )
        if self.geometry is None:
            self.geometry = geometry
        table = call.req_to_token
        # The latest table (a model may attach another cache), kept as the tensor first seen
        # for its storage: an alias of it (breakable's eager breaks get non-owning ones) would
        # dangle once the cache is freed.
        if self.req_to_token is None or table_key(self.req_to_token) != table_key(table):
            self.req_to_token = table
        return self.geometry

    def _workspace_buffer(self) -> torch.Tensor:
        if self._workspace is None:
            assert self.geometry is not None
            self._workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=self.geometry.device)
        return self._workspace

    def _build_decode(self, state: DecodeState, graph: bool) -> None:
        geometry, req_to_token = self.geometry, self.req_to_token
        assert geometry is not None and req_to_token is not None
        device, bs = geometry.device, state.batch_size
        if graph:
            state.indptr = torch.zeros(bs + 1, dtype=torch.int32, device=device)
            state.indices = torch.zeros(bs * req_to_token.shape[1], dtype=torch.int32, device=device)
            state.last_page_len = torch.ones(bs, dtype=torch.int32, device=device)
            state.wrapper = _flashinfer().BatchDecodeWithPagedKVCacheWrapper(
                self._workspace_buffer(),
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=state.indptr,
                paged_kv_indices_buffer=state.indices,
                paged_kv_last_page_len_buffer=state.last_page_len,
            )
            self.state_builds[state.key] = self.state_builds.get(state.key, 0) + 1
        else:
            state.wrapper = _flashinfer().BatchDecodeWithPagedKVCacheWrapper(
                self._workspace_buffer(), "NHD", use_tensor_cores=self.use_tensor_cores
            )

    def attach_kv_cache(self, cache: Any) -> None:
        """Plan every later hook over ``cache.req_to_token`` (None: forget the table until
        the next forward's first layer): a hook runs before the forward's layers, so
        without this it would plan over the previous cache's table, whose rows and width
        the new batch's request rows and lengths need not fit."""
        self.req_to_token = None if cache is None else cache.req_to_token

    def _can_plan(self) -> bool:
        """Whether a hook can plan at once: the geometry is known (a forward ran) and so
        is the table (else the next forward's first layer plans)."""
        return self.geometry is not None and self.req_to_token is not None

    # -- plans -------------------------------------------------------------------------
    def _ran(self, wrapper: Any) -> None:
        """Note an eager run of ``wrapper`` (not one recorded into a graph) on the current
        stream, for :meth:`_after_runs_of`."""
        if _capturing():
            return
        entry = self._runs.get(wrapper)
        event = entry[0] if entry is not None else (self.event_factory or torch.cuda.Event)()
        event.record()
        self._runs[wrapper] = (event, _stream_id())

    def _after_runs_of(self, wrapper: Any) -> None:
        """Order a plan of ``wrapper`` after its latest run when that ran on another stream
        (a capture's warm-ups and eager breaks run on the capture stream, the hooks on the
        caller's): a plan rewrites the wrapper's int workspace and index buffers, and frees
        the ones it replaces, which that run may still be reading. A device-side wait, no
        host sync; nothing on one stream, whose order already holds."""
        entry = self._runs.get(wrapper)
        stream = _stream_id()
        if entry is not None and entry[1] != stream:
            entry[0].wait()
            self._runs[wrapper] = (entry[0], stream)  # this stream is ordered after that run now

    def _ones(self, n: int) -> torch.Tensor:
        """``last_page_len`` of ``n`` requests (page size 1): pinned, never written after
        it is made, so copies from it may still be pending when it is handed out again."""
        ones = self._last_page_lens.get(n)
        if ones is None:
            ones = self._last_page_lens[n] = _pinned_ints([1] * n, torch.int32)
        return ones

    def _plan_decode(self, state: DecodeState, batch: ForwardBatch, lens: List[int], kind: str) -> None:
        geometry, req_to_token = self.geometry, self.req_to_token
        assert geometry is not None and req_to_token is not None
        graph = state.indices is not None
        self._after_runs_of(state.wrapper)
        if graph:
            if len(lens) != state.batch_size:
                raise ValueError(
                    f"attention {self.name!r}: {len(lens)} host lengths for graph {state.key} of "
                    f"{state.batch_size} requests"
                )
            assert state.indices is not None
            write_page_ids(state.indices, req_to_token, batch.req_pool_indices, lens)
            # The page ids are in the wrapper's own index buffer already: an empty view makes
            # plan()'s copy of `indices` into that buffer copy nothing (it reads no more of it).
            indices = state.indices[:0]
        else:
            indices = torch.empty(sum(lens), dtype=torch.int32, device=geometry.device)
            write_page_ids(indices, req_to_token, batch.req_pool_indices, lens)
        with self.pinned_ring.planning(state.wrapper):
            state.wrapper.plan(
                _indptr(lens),
                indices,
                self._ones(len(lens)),
                geometry.num_qo_heads,
                geometry.num_kv_heads,
                geometry.head_dim,
                1,
                window_left=geometry.window_left,
                q_data_type=geometry.dtype,
                kv_data_type=geometry.dtype,
                sm_scale=geometry.scaling,
                non_blocking=True,
            )
        state.planned = lens
        state.pending = None
        state.plans += 1
        self.plan_log.append((kind, state.key if graph else None, list(lens)))

    def _plan_prefill(self, batch: ForwardBatch, ext: List[int], pre: List[int], kind: str) -> None:
        geometry, req_to_token = self.geometry, self.req_to_token
        assert geometry is not None and req_to_token is not None
        if self._prefill is None:
            self._prefill = _flashinfer().BatchPrefillWithPagedKVCacheWrapper(self._workspace_buffer(), "NHD")
        kv = [n + p for n, p in zip(ext, pre)]
        self._after_runs_of(self._prefill)
        indices = torch.empty(sum(kv), dtype=torch.int32, device=geometry.device)
        write_page_ids(indices, req_to_token, batch.req_pool_indices, kv)
        self._prefill_plan = None  # until this plan is made
        with self.pinned_ring.planning(self._prefill):
            self._prefill.plan(
                _indptr(ext),
                _indptr(kv),
                indices,
                self._ones(len(kv)),
                geometry.num_qo_heads,
                geometry.num_kv_heads,
                geometry.head_dim,
                1,
                causal=True,
                sm_scale=geometry.scaling,
                window_left=geometry.window_left,
                q_data_type=geometry.dtype,
                kv_data_type=geometry.dtype,
                non_blocking=True,
            )
        self._prefill_plan = (weakref.ref(batch), _prefill_key(batch, ext, pre, req_to_token))
        self.plan_log.append((kind, graph_key(batch) if isinstance(batch, StaticForwardBatch) else None, kv))

    def _check_mode(self, mode: ForwardMode) -> None:
        if mode not in (ForwardMode.DECODE, ForwardMode.EXTEND):
            raise NotImplementedError(
                f"attention {self.name!r} plans DECODE and EXTEND batches only, not {mode.value}: "
                "use attention 'torch' or 'triton' for it"
            )

    # -- hooks -------------------------------------------------------------------------
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        mode = batch.forward_mode
        self._check_mode(mode)
        if mode is ForwardMode.DECODE:
            lens = batch.seq_lens_cpu
            host = _host_lens(lens if lens is not None else batch.seq_lens.tolist(), "seq_lens_cpu")
            self._eager_pending = (weakref.ref(batch), (tuple(host),))
        else:
            ext, pre = _extend_lens(batch, allow_device=True)
            self._eager_pending = (weakref.ref(batch), (tuple(ext), tuple(pre)))
        if self._can_plan():
            self._plan_eager(batch)

    def _plan_eager(self, batch: ForwardBatch) -> None:
        assert self._eager_pending is not None
        lens = self._eager_pending[1]
        if batch.forward_mode is ForwardMode.DECODE:
            if self._eager_decode is None:
                self._eager_decode = DecodeState(("eager",), 0)
                self._build_decode(self._eager_decode, graph=False)
            self._eager_plan = None  # until this plan is made
            self._plan_decode(self._eager_decode, batch, list(lens[0]), "eager")
            assert self.req_to_token is not None
            self._eager_plan = (weakref.ref(batch), lens, table_key(self.req_to_token), _stream_id())
        else:
            self._plan_prefill(batch, list(lens[0]), list(lens[1]), "eager")
        self._eager_pending = None

    def init_cuda_graph_state(self, batch: ForwardBatch) -> DecodeState:
        key = graph_key(batch)
        state = DecodeState(key, key[2])
        if self._can_plan():
            self._build_decode(state, graph=True)
        return state

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        self._check_mode(batch.forward_mode)
        if batch.forward_mode is ForwardMode.EXTEND:
            self._plan_static_extend(batch, "capture")
            return
        key = graph_key(batch)
        state = self.states.get(key)
        if state is None:  # only when absent: a recorded graph reads this state's buffers
            state = self.states[key] = self.init_cuda_graph_state(batch)
        lens = _host_lens(batch.seq_lens_cpu, "seq_lens_cpu")
        if state.wrapper is None:
            state.pending = lens  # planned by the first warm-up forward's first layer
        else:
            self._plan_decode(state, batch, lens, "capture")

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        if batch.forward_mode is ForwardMode.EXTEND:
            self._plan_static_extend(batch, "replay")
            return
        self._check_mode(batch.forward_mode)
        key = graph_key(batch)
        state = self.states.get(key)
        if state is None or state.wrapper is None:
            raise FlashInferPlanError(
                f"attention {self.name!r}: replay of graph {key} has no wrapper: the capture hook never ran for "
                "it, or cleanup dropped it (capture again after cleanup)"
            )
        if self.req_to_token is None:
            raise FlashInferPlanError(
                f"attention {self.name!r}: replay of graph {key} with no KV cache attached to the model"
            )
        self._plan_decode(state, batch, _host_lens(batch.seq_lens_cpu, "seq_lens_cpu"), "replay")

    def _plan_static_extend(self, batch: ForwardBatch, kind: str) -> None:
        ext, pre = _extend_lens(batch, allow_device=False)
        if not self._can_plan():
            self._prefill_plan = None  # the op plans at its first layer (it has both)
            return
        self._plan_prefill(batch, ext, pre, kind)

    def cleanup_cuda_graph_state(self, mode: Optional[ForwardMode] = None) -> None:
        for key in [k for k in self.states if mode is None or k[0] is mode]:
            del self.states[key]

    # -- forwards ----------------------------------------------------------------------
    def forward(
        self,
        output: torch.Tensor,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        req_to_token: torch.Tensor,
        scaling: float,
        sliding_window: int,
        last_layer: bool,
    ) -> None:
        flashinfer_attention(output, q, k_cache, v_cache, req_to_token, scaling, sliding_window, last_layer, self.id)

    def _run(self, call: AttentionCall) -> None:
        batch = call.batch
        self._check_mode(batch.forward_mode)
        first = self.geometry is None
        geometry = self._learn(call)
        kv = (call.k_cache.unsqueeze(1), call.v_cache.unsqueeze(1))  # [slots, page_size 1, kv_heads, d]
        heads, d = geometry.num_qo_heads, geometry.head_dim
        decode_graph = batch.forward_mode is ForwardMode.DECODE and isinstance(batch, StaticForwardBatch)
        if not decode_graph and _capturing():
            # Only a decode graph's wrapper has buffers at fixed addresses that the replay hook
            # re-plans in place; the eager wrappers' plans make new tensors every time, so a
            # recorded run would replay the capture's plan over freed memory.
            raise FlashInferPlanError(
                f"attention {self.name!r}: a {batch.forward_mode.value} forward of "
                f"{'a static' if isinstance(batch, StaticForwardBatch) else 'a live'} batch is being recorded "
                "into a graph; only decode graphs are capture-safe (prefill: use backend breakable or "
                "tc_piecewise, which run this op eagerly between graph pieces)"
            )
        if batch.forward_mode is ForwardMode.DECODE:
            wrapper = self._decode_wrapper(batch, first)
            bs = batch.req_pool_indices.shape[0]
            wrapper.run(call.q.view(bs, heads, d), kv, out=call.output.view(bs, heads, d))
            self._ran(wrapper)
            return
        ext, pre = _extend_lens(batch, allow_device=not isinstance(batch, StaticForwardBatch))
        plan = self._prefill_plan
        if plan is None or plan[0]() is not batch or plan[1] != _prefill_key(batch, ext, pre, call.req_to_token):
            # No hook planned this batch (or only before the geometry was known, or on another
            # stream): the op runs eagerly (EXTEND is never recorded), so planning here is
            # safe and correct.
            self._plan_prefill(batch, ext, pre, "forward")
        total = sum(ext)
        self._prefill.run(call.q[:total].view(total, heads, d), kv, out=call.output[:total].view(total, heads, d))
        self._ran(self._prefill)
        call.output[total:].zero_()  # padded tail tokens belong to no request

    def _decode_wrapper(self, batch: ForwardBatch, first: bool) -> Any:
        if isinstance(batch, StaticForwardBatch):
            key = graph_key(batch)
            state = self.states.get(key)
            if state is None:
                raise FlashInferPlanError(
                    f"attention {self.name!r}: a graph forward of {key} has no state: the capture hook "
                    "(init_forward_metadata_capture) did not run for it, or cleanup dropped it"
                )
            if state.wrapper is None or state.pending is not None:
                if _capturing():
                    raise FlashInferPlanError(
                        f"attention {self.name!r}: graph {key} is being recorded with no plan (the capture hook "
                        "ran before the model's first forward and no warm-up forward ran before the capture)"
                    )
                if state.wrapper is None:
                    self._build_decode(state, graph=True)
                lens = (
                    state.pending
                    if state.pending is not None
                    else _host_lens(_stored(batch, "seq_lens_cpu"), "seq_lens_cpu")
                )
                self._plan_decode(state, batch, lens, "capture")
            return state.wrapper
        pending = self._eager_pending
        if pending is not None and pending[0]() is batch:
            self._plan_eager(batch)  # the hook ran before the geometry was known
        plan = self._eager_plan
        assert self.req_to_token is not None
        if plan is not None and plan[0]() is batch and plan[2:] != (table_key(self.req_to_token), _stream_id()):
            # Planned over another cache's table, or on another stream: again, here.
            self._eager_pending = (plan[0], plan[1])
            self._plan_eager(batch)
            plan = self._eager_plan
        if plan is None or plan[0]() is not batch:
            raise FlashInferPlanError(
                f"attention {self.name!r}: an eager decode forward ran without init_forward_metadata(batch) "
                f"for that batch ({batch.batch_size} requests)"
            )
        assert self._eager_decode is not None
        return self._eager_decode.wrapper


def _prefill_key(batch: ForwardBatch, ext: Sequence[int], pre: Sequence[int], req_to_token: torch.Tensor) -> tuple:
    """What an extend plan of ``batch`` depends on besides the batch object (which a runner
    reuses for every replay of one padded size): the host lengths, the table by storage
    (:func:`table_key`), the request rows' tensor by address (its values are on the device)
    and the stream the plan's buffers belong to (:func:`_stream_id`). Plain ints and tuples:
    comparing two keys never touches a tensor."""
    rows = batch.req_pool_indices
    return (tuple(ext), tuple(pre), table_key(req_to_token), rows.data_ptr() if rows is not None else 0, _stream_id())


def _extend_lens(batch: ForwardBatch, *, allow_device: bool) -> Tuple[List[int], List[int]]:
    ext, pre = _stored(batch, "extend_seq_lens_cpu"), _stored(batch, "extend_prefix_lens_cpu")
    if ext is None and allow_device and batch.extend_seq_lens is not None:
        ext = batch.extend_seq_lens.tolist()
    ext_l = _host_lens(ext, "extend_seq_lens_cpu")
    if pre is None and allow_device and batch.extend_prefix_lens is not None:
        pre = batch.extend_prefix_lens.tolist()
    return ext_l, [int(x) for x in pre] if pre is not None else [0] * len(ext_l)


def make_flashinfer_attention(use_tensor_cores: bool = False) -> FlashInferAttention:
    """A new ``flashinfer`` (``flashinfer_tc`` with ``use_tensor_cores``) backend; imports
    ``flashinfer`` here, so a broken install is reported when the model is built.

    Raises:
        ValueError: the ``flashinfer`` package is not installed, or its import fails (names
            the error, e.g. a missing dependency; says how to install it).
    """
    name = "flashinfer_tc" if use_tensor_cores else "flashinfer"
    install = "pip install 'cuda-graph-runner[flashinfer]' (or use attention 'torch')"
    if not flashinfer_available():
        raise ValueError(f"attention={name!r} needs the flashinfer-python package, which is not installed: {install}")
    try:
        _flashinfer()
    except Exception as exc:  # an import error of one of its dependencies, an ABI mismatch
        raise ValueError(
            f"attention={name!r}: importing flashinfer failed ({type(exc).__name__}: {exc}); {install}"
        ) from exc
    return FlashInferAttention(use_tensor_cores=use_tensor_cores)
