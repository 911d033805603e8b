"""``triton``: the reference model's attention as Triton paged kernels
(:mod:`.triton_kernels`; the algorithm in plain PyTorch: :mod:`.paged_attention_model`).

* DECODE / TARGET_VERIFY / DLLM_EXTEND: one split-KV kernel (grid ``(batch size, KV
  heads, splits)``: the GQA query heads of one KV head, times the request's width, are
  the rows of one program, so each K/V block is loaded once for them) reading the page
  table ``req_to_token`` and ``seq_lens`` on the device, and one merge kernel.
  Capture-safe (the marked op declares those modes): ``full`` and compiled full record
  it, ``breakable`` records it inside its segment. ``tc_piecewise`` splits its FX graph
  at every marked op, capture-safe or not, so there the op does not stay inside a
  piece: it runs eagerly between pieces at replay (host-bound, as the ``torch``
  attention there).
* EXTEND: one kernel per layer over a tile table built on the host from the batch's
  host lengths by the first layer of the forward (shared by the others through
  :func:`~cuda_graph_runner.backend.context.forward_scratch`); causal, cached prefixes,
  ragged requests, the model's sliding window. Not capture-safe on its own (the tile
  count follows the request lengths): it breaks a prefill graph, as ``torch``'s extend
  does, except in a graph forward whose capture hook planned it (below), which reads a
  fixed-size tile table that the replay hook refills.

The split count is fixed per *padded* batch size
(:func:`.paged_attention_model.decode_num_splits`): a graph forward (a
:class:`~cuda_graph_runner.backend.forward_batch.StaticForwardBatch`: capture, warm-up, a replay
that runs the op) records its batch size per (mode, width), and an eager forward of
``n`` requests uses the count of the smallest recorded size ``>= n`` (``n`` itself when
none is), the size a runner pads it to. So a replay and the eager forward of the same
batch (verify mode, the fallback) reduce each request's keys in the same order.

Opaque to every compiler: Dynamo records the marked op ``triton_paged_attention`` as one
call (its fake runs while tracing), compiled full does not compile its body at compile
sizes (``torch.compiler.disable``: host bookkeeping only), and the body launches the
kernels through two custom ops of their own with fake implementations
(``cuda_graph_runner::triton_decode_attention``, ``cuda_graph_runner::triton_extend_attention``),
so whatever traces the backend's code records those calls and never the user-defined
Triton kernels (inductor would type a Python float argument of one as fp64).

Plans EXTEND graphs only (:attr:`plans` True; decode-like modes plan nothing, so a
hand-written decode graph of the model is a valid baseline): the capture hook of a
prefill graph gives it a tile table of a fixed row count
(:func:`.extend_plan.max_extend_tiles` of its tokens and requests) and the replay hook
refills it from the static batch's host lengths, padded with empty tiles
(:func:`.extend_plan.padded_extend_tiles`), so the extend kernel's grid is fixed and a
graph that records it (prefill ``full``, with request slots) replays the live batch.

Needs the ``triton`` package (``pip install 'cuda-graph-runner[triton]'``) and CUDA
tensors, or CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1`` before the first
forward imports the kernels).
"""

from __future__ import annotations

import collections
import importlib.util
import itertools
import weakref
from typing import Any, Dict, Optional, Set, Tuple

import torch

from ...backend.context import forward_scratch, get_forward_batch
from ...backend.forward_batch import ForwardMode, StaticForwardBatch
from ...backend.graph_break import eager_op
from .attention import AttentionCall
from .attention_backend import AttentionBackend, graph_key
from .extend_plan import host_to_device, max_extend_tiles, padded_extend_tiles
from .paged_attention_model import decode_num_splits, extend_tiles

#: The extend kernel's query rows per tile.
EXTEND_BLOCK_M = 64

_instances: "weakref.WeakValueDictionary[int, TritonAttention]" = weakref.WeakValueDictionary()
_ids = itertools.count(1)


def triton_available() -> bool:
    """True when the ``triton`` package can be imported (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when the kernels were defined under Triton's interpreter (``TRITON_INTERPRET=1``
    when :mod:`.triton_kernels` was first imported): they then run on CPU tensors. Imports
    the kernels (False without triton)."""
    try:
        kernels = _kernels()
    except ImportError:
        return False
    return type(kernels._decode_split_kernel).__name__ == "InterpretedFunction"


def _kernels() -> Any:
    from . import triton_kernels  # lazy: triton is optional and slow to import

    return triton_kernels


@torch.library.custom_op("cuda_graph_runner::triton_decode_attention", mutates_args=("output",))
def decode_attention_op(
    output: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    width: int,
    num_splits: int,
    scaling: float,
    sliding_window: int,
    bidirectional: bool,
    block_n: int,
) -> None:
    """:func:`.triton_kernels.decode_attention` as one opaque op (arguments as there):
    whatever traces the backend (Dynamo, inductor, a marked op's compiled body) records
    this call and never the user-defined Triton kernels inside."""
    _kernels().decode_attention(
        output, q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
        width=width, num_splits=num_splits, scaling=scaling, sliding_window=sliding_window,
        bidirectional=bidirectional, block_n=block_n,
    )  # fmt: skip


@decode_attention_op.register_fake
def _decode_attention_fake(output: torch.Tensor, *args: Any) -> None:
    return None  # writes ``output`` in place: its shape and dtype are the output's


@torch.library.custom_op("cuda_graph_runner::triton_extend_attention", mutates_args=("output",))
def extend_attention_op(
    output: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    tiles: torch.Tensor,
    num_tiles: int,
    scaling: float,
    sliding_window: int,
    block_m: int,
    block_n: int,
) -> None:
    """:func:`.triton_kernels.extend_attention` as one opaque op (arguments as there)."""
    _kernels().extend_attention(
        output, q, k_cache, v_cache, req_to_token, req_pool_indices, tiles, num_tiles,
        scaling=scaling, sliding_window=sliding_window, block_m=block_m, block_n=block_n,
    )  # fmt: skip


@extend_attention_op.register_fake
def _extend_attention_fake(output: torch.Tensor, *args: Any) -> None:
    return None


def _launcher(op: Any, name: str) -> Any:
    """The kernel op ``op`` while a compiler traces (the opaque call it records), else the
    launcher itself (eager calls and captures skip the custom op's dispatch)."""
    return op if torch.compiler.is_compiling() else getattr(_kernels(), name)


@eager_op("triton_paged_attention", capture_safe=("decode", "target_verify", "dllm_extend"))
@torch.compiler.disable  # its body is host bookkeeping around opaque kernel ops: nothing to compile
def triton_paged_attention(
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
    """The ``triton`` attention (arguments as ``reference_llama_attention``'s, plus the id
    of the backend instance, whose recorded graph sizes fix the decode split count)."""
    call = AttentionCall(output, q, k_cache, v_cache, req_to_token, scaling, sliding_window, get_forward_batch())
    backend = _instances[backend_id]
    if call.batch.forward_mode.is_decode_like():
        backend.forward_decode(call, last_layer)
    else:
        backend.forward_extend(call)


class TritonAttention(AttentionBackend):
    """``triton``: see the module docstring.

    Attributes:
        graph_sizes: batch sizes of the graph forwards seen, per ``(mode, width)``.
        decode_block_n: keys per block of the decode kernel.
        extend_block_m, extend_block_n: query rows per tile and keys per block of the
            extend kernel.

    Raises (at a forward):
        RuntimeError: CPU tensors outside Triton's interpreter.
    """

    name = "triton"
    plans = True
    replans_prefill_graphs = True  # the replay hook refills each prefill graph's tile table

    def __init__(self, decode_block_n: int = 64, extend_block_m: int = EXTEND_BLOCK_M, extend_block_n: int = 64):
        self.id = next(_ids)
        _instances[self.id] = self
        self.graph_sizes: Dict[Tuple[ForwardMode, int], Set[int]] = collections.defaultdict(set)
        self.decode_block_n = decode_block_n
        self.extend_block_m = extend_block_m
        self.extend_block_n = extend_block_n
        self._scratch_key = ("triton_attention_tiles", self.id)
        #: EXTEND graphs' tile tables by graph key: ``[tile rows, 5]`` int32 and whether the
        #: last plan fitted (a backend that runs attention eagerly may replay more requests).
        self.extend_states: Dict[tuple, list] = {}

    # -- EXTEND graph plans (decode-like modes plan nothing) -------------------------------
    def init_forward_metadata_capture_cuda_graph(self, batch: Any) -> None:
        if batch.forward_mode.is_decode_like():
            return
        key = graph_key(batch)
        state = self.extend_states.get(key)
        if state is None:  # only when absent: a recorded graph reads this table's address
            rows = max_extend_tiles(batch.input_ids.shape[0], batch.req_pool_indices.shape[0], self.extend_block_m)
            table = torch.zeros(rows, 5, dtype=torch.int32, device=batch.input_ids.device)
            state = self.extend_states[key] = [table, False]
        self._plan_extend(state, batch)

    def init_forward_metadata_replay_cuda_graph(self, batch: Any) -> None:
        if batch.forward_mode.is_decode_like():
            return
        state = self.extend_states.get(graph_key(batch))
        if state is not None:
            self._plan_extend(state, batch)

    def cleanup_cuda_graph_state(self, mode: Optional[ForwardMode] = None) -> None:
        for key in [k for k in self.extend_states if mode is None or k[0] is mode]:
            del self.extend_states[key]

    def _plan_extend(self, state: list, batch: Any) -> None:
        table = state[0]
        ext, pre = batch.extend_seq_lens_cpu, batch.extend_prefix_lens_cpu  # hooks run outside the guard
        if ext is None:
            state[1] = False
            return
        pre = pre if pre is not None else [0] * len(ext)
        try:
            tiles = padded_extend_tiles(ext, pre, self.extend_block_m, table.shape[0])
        except ValueError:  # more requests than the capture's: the forward builds its own tiles
            state[1] = False
            return
        host_to_device([list(t) for t in tiles], table)
        state[1] = True

    def padded_batch_size(self, mode: ForwardMode, width: int, batch_size: int) -> int:
        """The smallest graph size recorded for ``(mode, width)`` that holds
        ``batch_size`` requests, else ``batch_size``."""
        fits = [s for s in self.graph_sizes.get((mode, width), ()) if s >= batch_size]
        return min(fits) if fits else batch_size

    def num_splits(self, batch: Any, num_kv_heads: int, max_context_len: int) -> int:
        """The decode split count of ``batch`` (records a graph forward's size)."""
        mode, width = batch.forward_mode, batch.num_tokens_per_req
        bs = int(batch.req_pool_indices.shape[0])
        if isinstance(batch, StaticForwardBatch):
            self.graph_sizes[(mode, width)].add(bs)
            padded = bs
        else:
            padded = self.padded_batch_size(mode, width, bs)
        return decode_num_splits(padded, num_kv_heads, max_context_len)

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
        triton_paged_attention(output, q, k_cache, v_cache, req_to_token, scaling, sliding_window, last_layer, self.id)

    def _check_device(self, t: torch.Tensor) -> None:
        if t.device.type != "cuda" and not interpreting():
            raise RuntimeError(
                f"attention 'triton' runs on CUDA tensors (or on CPU tensors in Triton's interpreter, "
                f"TRITON_INTERPRET=1); got tensors on {t.device}: use attention 'torch' there"
            )

    def forward_decode(self, call: AttentionCall, last_layer: bool) -> None:
        self._check_device(call.q)
        batch = call.batch
        splits = self.num_splits(batch, call.k_cache.shape[1], call.req_to_token.shape[1])
        _launcher(decode_attention_op, "decode_attention")(
            call.output, call.q, call.k_cache, call.v_cache, call.req_to_token,
            batch.req_pool_indices, batch.seq_lens,
            width=batch.num_tokens_per_req, num_splits=splits, scaling=float(call.scaling),
            sliding_window=int(call.sliding_window), bidirectional=batch.forward_mode.is_block_bidirectional(),
            block_n=self.decode_block_n,
        )  # fmt: skip

    def forward_extend(self, call: AttentionCall) -> None:
        self._check_device(call.q)
        batch = call.batch
        planned = self.extend_states.get(graph_key(batch)) if isinstance(batch, StaticForwardBatch) else None
        if planned is not None and planned[1]:
            # A graph forward with its hook's plan: fixed grid, lengths in the table, every
            # row written (tiles cover the live tokens; the padding is zeroed first).
            call.output.zero_()
            table = planned[0]
            _launcher(extend_attention_op, "extend_attention")(
                call.output, call.q, call.k_cache, call.v_cache, call.req_to_token, batch.req_pool_indices,
                table, int(table.shape[0]), scaling=float(call.scaling), sliding_window=int(call.sliding_window),
                block_m=self.extend_block_m, block_n=self.extend_block_n,
            )  # fmt: skip
            return
        scratch: Dict[Any, Any] = forward_scratch()
        entry = scratch.get(self._scratch_key)
        if entry is None:  # the first layer of the forward builds the tile table
            ext, pre = batch.extend_seq_lens_cpu, batch.extend_prefix_lens_cpu
            # Host lists are the contract; fall back to a device read when a builder left them out.
            if ext is None:
                if batch.extend_seq_lens is None:
                    raise RuntimeError("EXTEND batch has neither extend_seq_lens_cpu nor extend_seq_lens")
                ext = batch.extend_seq_lens.tolist()
            if pre is None:
                pre = batch.extend_prefix_lens.tolist() if batch.extend_prefix_lens is not None else [0] * len(ext)
            tiles = extend_tiles(ext, pre, self.extend_block_m)
            table = _kernels().extend_tile_tensor(tiles, call.q.device)
            entry = scratch[self._scratch_key] = (table, len(tiles), sum(int(n) for n in ext))
        table, num_tiles, total = entry
        _launcher(extend_attention_op, "extend_attention")(
            call.output, call.q, call.k_cache, call.v_cache, call.req_to_token, batch.req_pool_indices,
            table, num_tiles, scaling=float(call.scaling), sliding_window=int(call.sliding_window),
            block_m=self.extend_block_m, block_n=self.extend_block_n,
        )  # fmt: skip
        # Padded tail tokens (a prefill runner's padding) belong to no request.
        call.output[total:].zero_()


def make_triton_attention() -> TritonAttention:
    """A new ``triton`` backend.

    Raises:
        ValueError: the ``triton`` package is not installed (says how to install it).
    """
    if not triton_available():
        raise ValueError(
            "attention='triton' needs the triton package, which is not installed: "
            "pip install 'cuda-graph-runner[triton]' (or use attention 'torch')"
        )
    return TritonAttention()
