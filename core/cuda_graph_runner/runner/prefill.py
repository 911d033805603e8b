"""``PrefillCudaGraphRunner``: graphs keyed by total token count, for EXTEND (prefill) batches.

What is captured is the model body, ``model.forward(batch) -> hidden [T, H]``; the LM
head runs eagerly afterwards on the live batch, because which rows it reads (the last
token of each request) depends on per-request lengths (sglang stage C prefill runner:
"only the inner transformer body is captured; LM head / logits processor run eagerly").

Per-request metadata cannot be frozen into a prefill graph: the number of requests and
their lengths change every batch while the token count stays on a bucket. So only the
token axis is a graph input; the request axis reaches the model's marked eager ops
(attention) through :func:`~cuda_graph_runner.backend.context.get_forward_batch`, and
a backend runs those ops eagerly at replay (``breakable``, ``tc_piecewise``), or records
them with the rest (``full``: the backend's ``records_marked_ops``). Then the request
axis is fixed per graph too: each token bucket is captured with ``request_slots``
requests (config ``full_prefill_max_req``, default ``max(1, max_tokens // 512)``), a live
batch's requests are padded to that count with zero-length sentinel requests (request
row 0, no tokens, no prefix), and the model's replay hook
``init_forward_metadata_replay`` re-plans its attention from the slot-padded host
lengths into the buffers the graph recorded (sglang's full prefill graphs,
``full_prefill_max_req``). A batch of more requests than slots runs eagerly (fallback
reason ``"more requests than slots"``).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, List, Optional, Tuple

import torch

from ..backend.base import ShapeKey
from ..backend.buffers import BATCH_AXIS, TOKEN_AXIS, FusedFill
from ..backend.context import forward_context
from ..backend.forward_batch import ForwardBatch, ForwardMode, StaticBatchUpdater, StaticForwardBatch, _stored
from ..config import ConfigInput, CudaGraphConfigError
from .base import MAX_REPLAY_PLANS, BaseCudaGraphRunner, get_batch_sizes_to_capture
from .model_protocol import GraphModel
from .stats import REASON_PADDING, REASON_SLOTS

#: Token-axis buffers copied from the live batch at every replay: (field, dtype).
#: All are index-like and pad with 0: padded tokens read token 0 at position 0 and
#: write their K/V into the reserved dummy slot 0.
_PREFILL_SLOTS = (
    ("input_ids", torch.int64),
    ("positions", torch.int64),
    ("out_cache_loc", torch.int64),
)

#: Request-axis buffers of a runner with request slots (backend ``full``): (field, dtype).
#: Sentinel requests are all zeros: the reserved request row 0, no tokens, no prefix.
_REQUEST_SLOTS = (
    ("req_pool_indices", torch.int64),
    ("seq_lens", torch.int32),
    ("extend_seq_lens", torch.int32),
    ("extend_prefix_lens", torch.int32),
)

#: A padded size above this multiple of the real token count runs eagerly: the padding
#: would cost more compute than the graph saves (sglang ``can_replay_locally``).
MAX_PADDING_RATIO = 2


def default_prefill_token_sizes(max_tokens: int) -> List[int]:
    """sglang's prefill token buckets, cut at ``max_tokens`` (``max_tokens`` itself is not
    added: sglang's ``generate_prefill_cuda_graph_batch_sizes``).

    4..32 step 4, 48..256 step 16, 288..512 step 32, 576..1024 step 64,
    1280..4096 step 256, 4608.. step 512.
    """
    sizes = (
        list(range(4, 33, 4))
        + list(range(48, 257, 16))
        + list(range(288, 513, 32))
        + list(range(576, 1025, 64))
        + list(range(1280, 4097, 256))
        + list(range(4608, max_tokens + 1, 512))
    )
    return [s for s in sizes if s <= max_tokens]


class PrefillCudaGraphRunner(BaseCudaGraphRunner):
    """Prefill runner: one graph per total token count; logits ``[batch_size, vocab]`` float32 out.

    A live EXTEND batch of ``T`` tokens (any number of requests, any lengths, any cached
    prefixes) is padded to the smallest captured token count ``P >= T``:

    * ``input_ids``, ``positions``, ``out_cache_loc`` (``[P]`` int64) are the graph inputs,
      copied into static buffers with a zeroed tail (token 0, position 0, dummy KV slot 0);
    * request-axis fields (``req_pool_indices``, ``seq_lens``, ``extend_seq_lens``,
      ``extend_prefix_lens`` and the ``*_cpu`` host lists) are *not* graph inputs: the
      static batch carries the live ones, which the model's marked eager ops read through
      ``get_forward_batch()``. ``sum(extend_seq_lens)`` is then ``T < P``: tokens past it
      are padding, which those ops must leave finite (the reference attention zeroes them);
    * the graph returns ``hidden [P, H]``; ``hidden[:T]`` goes through
      ``model.compute_logits(hidden, live_batch)`` eagerly (one row per request).

    A batch runs eagerly when ``T`` exceeds the largest captured size, or when ``P > 2 T``
    (sglang's padding-waste rule).

    Request slots (a backend with ``records_marked_ops``, i.e. ``full``): the request axis
    is a graph input too. ``req_pool_indices`` ``[S]`` int64 and ``seq_lens``,
    ``extend_seq_lens``, ``extend_prefix_lens`` ``[S]`` int32 are static buffers holding
    the live requests then zero-length sentinels (all zeros) up to :attr:`request_slots`
    ``S``; the host lists are padded with zeros the same way, and the model's
    ``init_forward_metadata_replay`` re-plans the attention from them before every
    replay. A batch of more than ``S`` requests runs eagerly (``"more requests than
    slots"``). ``compute_logits`` still gets the live batch (one row per live request).

    Outputs: the same contract as every runner (:class:`BaseCudaGraphRunner`): valid until
    the next replay of any graph in the pool. The logits computed eagerly from the hidden
    states are in fact fresh; ``owned_outputs=True`` copies only what ``compute_logits``
    returns that shares memory with the graph's hidden states (normally nothing).

    Default sizes: :func:`default_prefill_token_sizes` cut at ``phase_config.max_bs``
    (default 4096), the maximum itself always captured. Capture builds a dummy batch of
    as few requests as possible, each at most ``max_request_tokens`` long, all on the
    reserved request row 0.

    Args (beyond :class:`BaseCudaGraphRunner`'s):
        max_request_tokens: longest dummy request at capture (the model's context length,
            so the model's attention can address it). None: ``model.kv_cache.max_context_len``
            when the model has one, else one request per captured size.

    Model code inside the captured body must not read request-axis fields in EXTEND mode
    (they would be frozen at capture); only marked eager ops may, through the forward
    context.
    """

    phase: ClassVar[str] = "prefill"
    mode: ForwardMode = ForwardMode.EXTEND
    default_max_size: ClassVar[int] = 4096
    #: A padded size above this multiple of the token count runs eagerly (and, under
    #: ``padded_eager``, at its live size: :mod:`.padded_eager`).
    max_padding_ratio: ClassVar[int] = MAX_PADDING_RATIO

    def __init__(
        self, model: GraphModel, config: ConfigInput = None, *, max_request_tokens: Optional[int] = None, **kwargs: Any
    ) -> None:
        if max_request_tokens is not None and max_request_tokens < 1:
            raise ValueError(f"max_request_tokens={max_request_tokens}: must be >= 1")
        self.max_request_tokens = max_request_tokens
        self._capture_req: Optional[dict] = None
        #: Requests per graph when the backend records attention (``full``), else None
        #: (any request count; set when the buffers are made): ``full_prefill_max_req``,
        #: else ``max(1, max_size // 512)`` raised to the dummy requests a capture of
        #: ``max_size`` tokens takes (each at most the context length).
        self.request_slots: Optional[int] = None
        self._slot_fills: dict = {}
        super().__init__(model, config, **kwargs)

    def _init_request_slots(self) -> None:
        """Fix the request axis when the backend records the marked ops (``full``): the
        slot count, its static buffers, and the check that the model's attention updates
        its metadata outside the graph.

        Raises:
            CudaGraphConfigError: the model has no replay hook (its attention plans
                nothing, e.g. ``torch``: the graph would replay the capture's request
                lengths); a capture would need more dummy requests than slots.
        """
        if not getattr(self.backend, "records_marked_ops", False):
            return
        backend = self.backend.name or type(self.backend).__name__
        # A model may say outright whether its replay hook covers prefill graphs (the
        # reference model and the HF adapter do, from their attention): a hook that
        # re-plans decode graphs only would replay the capture's request lengths.
        replans = getattr(self.model, "replans_prefill_graphs", None)
        if replans is False or getattr(self.model, "init_forward_metadata_replay", None) is None:
            attention = getattr(getattr(self.model, "attn_backend", None), "name", None)
            what = f"attention {attention!r}" if attention else f"model {type(self.model).__name__}"
            raise CudaGraphConfigError(
                f"records attention into each prefill graph, so the attention must update its metadata outside "
                f"the graph (the model's init_forward_metadata_replay hook, with replans_prefill_graphs not False); "
                f"{what} has no such update for prefill graphs (they would replay the capture's request lengths)",
                phase=self.phase,
                key="backend",
                value=backend,
                accepted="an attention whose replay hook re-plans prefill graphs (triton; planned_standin on the CPU; "
                "flashinfer re-plans decode graphs only, so its prefill needs breakable), "
                "or prefill backend breakable or tc_piecewise",
                source=self.config.source_of(self.phase, "backend"),
            )
        slots = self.phase_config.request_slots(self.max_size)
        needed = max(len(self.capture_request_lens(size)) for size in self.capture_sizes)
        if self.phase_config.full_prefill_max_req is None:
            slots = max(slots, needed)  # the default grows to what a capture takes
        elif needed > slots:
            raise CudaGraphConfigError(
                f"gives {slots} request slots, but capturing {self.max_size} tokens takes {needed} requests of at "
                f"most {self._request_len_limit()} tokens (the context length)",
                phase=self.phase,
                key="full_prefill_max_req",
                value=self.phase_config.full_prefill_max_req,
                accepted=f"an integer >= {needed}, null (the default), or a smaller max_bs",
                source=self.config.source_of(self.phase, "full_prefill_max_req"),
            )
        self.request_slots = slots
        for name, dtype in _REQUEST_SLOTS:
            self.buffers.register(name, axis=BATCH_AXIS, rows=slots, dtype=dtype, pad_value=0)

    # -- policy ------------------------------------------------------------------------
    def get_sizes_to_capture(self) -> List[int]:
        if self.phase_config.bs or (self.phase_config.max_bs or self.default_max_size) >= 4:
            return get_batch_sizes_to_capture(
                self.phase_config, self.default_max_size, default_prefill_token_sizes, add_max=False
            )
        if self.is_disabled:  # captures nothing anyway; the size only bounds a replay
            return [self.phase_config.max_bs or self.default_max_size]
        # sglang captures no prefill graph here and runs every prefill eagerly; a graph
        # config that captures nothing is refused instead (backend disabled says it).
        raise CudaGraphConfigError(
            "is below the smallest prefill bucket (4 tokens), so no graph would be captured",
            phase=self.phase,
            key="max_bs",
            value=self.phase_config.max_bs,
            accepted="max_bs >= 4, explicit bs, or backend disabled",
            source=self.config.source_of(self.phase, "max_bs"),
        )

    def init_buffers(self) -> None:
        for name, dtype in _PREFILL_SLOTS:
            self.buffers.register(name, axis=TOKEN_AXIS, rows=self.max_size, dtype=dtype, pad_value=0)
        self._init_request_slots()

    def make_key(self, size: int) -> ShapeKey:
        return ShapeKey(size, "extend")

    def size_of(self, batch: ForwardBatch) -> int:
        return batch.num_tokens

    def batch_matches(self, batch: ForwardBatch) -> bool:
        return batch.forward_mode is ForwardMode.EXTEND

    has_batch_limits: ClassVar[bool] = True

    def batch_limit(self, batch: ForwardBatch, size: int, padded: int) -> Optional[str]:
        """``"more requests than slots"`` for a batch of more than :attr:`request_slots`
        requests (with request slots), ``"padding too large"`` for one padded to more than
        ``MAX_PADDING_RATIO`` times its token count, else None (see
        :meth:`BaseCudaGraphRunner.decide`)."""
        if not self.fits_graphs(batch):
            return REASON_SLOTS
        if padded > self.max_padding_ratio * size:
            return REASON_PADDING
        return None

    def fits_graphs(self, batch: ForwardBatch) -> bool:
        """False for a batch of more requests than :attr:`request_slots` (graphs with
        request slots take at most that many); True without request slots."""
        slots = self.request_slots
        return slots is None or int(batch.req_pool_indices.shape[0]) <= slots

    # -- capture -----------------------------------------------------------------------
    def _request_len_limit(self) -> Optional[int]:
        if self.max_request_tokens is not None:
            return self.max_request_tokens
        cache = getattr(self.model, "kv_cache", None)
        limit = getattr(cache, "max_context_len", None)
        return int(limit) if limit else None

    def _capture_request_buffers(self) -> dict:
        # Allocated once so that every capture's request-axis tensors live at stable
        # addresses for the runner's lifetime, even if a model (wrongly) reads them
        # inside a graph: stale values are a model bug, a freed address a crash.
        if self._capture_req is None:
            rows = self.max_size
            dev = self.device
            self._capture_req = {
                "req_pool_indices": torch.zeros(rows, dtype=torch.int64, device=dev),
                "seq_lens": torch.zeros(rows, dtype=torch.int32, device=dev),
                "extend_seq_lens": torch.zeros(rows, dtype=torch.int32, device=dev),
                "extend_prefix_lens": torch.zeros(rows, dtype=torch.int32, device=dev),
            }
        return self._capture_req

    def capture_request_lens(self, size: int) -> List[int]:
        """Lengths of the dummy requests of a ``size``-token capture (fewest requests)."""
        limit = self._request_len_limit() or size
        n = math.ceil(size / limit)
        return [limit] * (n - 1) + [size - limit * (n - 1)]

    def capture_prepare(self, size: int) -> ForwardBatch:
        # Token buffers hold their pad values (token 0, position 0, slot 0) outside replays.
        self.buffers.reset()
        lens = self.capture_request_lens(size)
        if self.request_slots is not None:
            return self._capture_slotted(size, lens)
        n = len(lens)
        req = self._capture_request_buffers()
        req["req_pool_indices"][:n].zero_()  # the reserved dummy row
        req["seq_lens"][:n].copy_(torch.tensor(lens, dtype=torch.int32))
        req["extend_seq_lens"][:n].copy_(torch.tensor(lens, dtype=torch.int32))
        req["extend_prefix_lens"][:n].zero_()
        view = self.buffers.view
        return StaticForwardBatch(  # host fields guarded during capture (host_guard)
            forward_mode=ForwardMode.EXTEND,
            input_ids=view("input_ids", size),
            positions=view("positions", size),
            out_cache_loc=view("out_cache_loc", size),
            req_pool_indices=req["req_pool_indices"][:n],
            seq_lens=req["seq_lens"][:n],
            extend_seq_lens=req["extend_seq_lens"][:n],
            extend_prefix_lens=req["extend_prefix_lens"][:n],
            seq_lens_cpu=list(lens),
            extend_seq_lens_cpu=list(lens),
            extend_prefix_lens_cpu=[0] * n,
        )

    def _capture_slotted(self, size: int, lens: List[int]) -> ForwardBatch:
        # The dummy requests then zero-length sentinels up to the slot count, in the
        # request buffers every replay of every size refills (stable addresses).
        slots = self.request_slots
        assert slots is not None
        pad = [0] * (slots - len(lens))
        host = {"seq_lens": lens + pad, "extend_seq_lens": lens + pad, "extend_prefix_lens": [0] * slots}
        self.buffers["req_pool_indices"].zero_()  # the reserved dummy row
        for name in host:
            self.buffers[name].copy_(torch.tensor(host[name], dtype=torch.int32))
        for name, _ in _REQUEST_SLOTS:
            self.buffers.slot(name).dirty = slots  # the next fill pads every row it does not write
        view = self.buffers.view
        return StaticForwardBatch(  # host fields guarded during capture (host_guard)
            forward_mode=ForwardMode.EXTEND,
            input_ids=view("input_ids", size),
            positions=view("positions", size),
            out_cache_loc=view("out_cache_loc", size),
            req_pool_indices=self.buffers["req_pool_indices"],
            seq_lens=self.buffers["seq_lens"],
            extend_seq_lens=self.buffers["extend_seq_lens"],
            extend_prefix_lens=self.buffers["extend_prefix_lens"],
            seq_lens_cpu=host["seq_lens"],
            extend_seq_lens_cpu=host["extend_seq_lens"],
            extend_prefix_lens_cpu=host["extend_prefix_lens"],
        )

    # -- replay ------------------------------------------------------------------------
    def replay_prepare(self, batch: ForwardBatch) -> Tuple[ShapeKey, ForwardBatch]:
        """Copy the token axis into the static buffers padded to a captured size.

        Returns ``(key, static_batch)``: token fields are ``[P]`` views of the static
        buffers; request fields and ``extra`` are the live batch's own (with request
        slots: the request fields are the slot buffers, the host lists slot-padded).

        One ``_foreach_copy_`` for the three token buffers, pad fills only for rows a
        larger batch left behind, and the one static batch of the padded size refreshed
        field by field (no new object per step; it is reused by later replays of that
        size). The plan of each token count is built once.

        Raises:
            ValueError: more tokens than the largest captured size, a token tensor
                without ``num_tokens`` rows, or of another dtype kind than its slot (float
                ``input_ids``: names the field and both dtypes); with request slots, more
                requests than slots.
        """
        tokens = batch.input_ids.shape[0]
        plan = self._replay_plans.get(tokens)
        if plan is None:
            plan = self._replay_plan(tokens)
        key, update, fill = plan
        fill((batch.input_ids, batch.positions, batch.out_cache_loc))
        static = update(batch)
        if self.request_slots is not None:
            self._fill_request_slots(batch, static)
        init = getattr(self.model, "init_forward_metadata_replay", None)
        if init is not None:
            init(static)
        return key, static

    def _fill_request_slots(self, batch: ForwardBatch, static: StaticForwardBatch) -> None:
        """Copy the live request axis into the request-slot buffers, the tail zeroed
        (sentinel requests), and pad the static batch's host lists with zeros.

        Raises:
            ValueError: more requests than slots (``forward`` runs such a batch eagerly).
        """
        slots = self.request_slots
        assert slots is not None
        n = int(batch.req_pool_indices.shape[0])
        if n > slots:
            raise ValueError(
                f"the batch has {n} requests but the prefill graphs have {slots} request slots "
                "(full_prefill_max_req): forward() runs it eagerly"
            )
        fill = self._slot_fills.get(n)
        if fill is None:
            names = [name for name, _ in _REQUEST_SLOTS]
            fill = self._slot_fills[n] = FusedFill(self.buffers, names, [n] * len(names), [slots] * len(names))
        prefix = batch.extend_prefix_lens
        if prefix is None:
            prefix = torch.zeros(n, dtype=torch.int32, device=batch.seq_lens.device)
        extend = batch.extend_seq_lens
        if extend is None:
            raise ValueError("an EXTEND batch for prefill graphs with request slots needs extend_seq_lens")
        fill((batch.req_pool_indices, batch.seq_lens, extend, prefix))
        buffers = self.buffers
        static.req_pool_indices = buffers["req_pool_indices"]
        static.seq_lens = buffers["seq_lens"]
        static.extend_seq_lens = buffers["extend_seq_lens"]
        static.extend_prefix_lens = buffers["extend_prefix_lens"]
        pad = [0] * (slots - n)
        for name, device in (
            ("seq_lens_cpu", None),
            ("extend_seq_lens_cpu", extend),
            ("extend_prefix_lens_cpu", prefix),
        ):
            host = _stored(batch, name)
            if host is None and device is not None:
                # The replay hook plans from host lengths; a batch built without them costs
                # a sync here rather than a replay of the previous plan.
                host = device.tolist()
            setattr(static, name, None if host is None else [*host, *pad])
        if self._decided is not None:  # a forward() replay: counted with the token padding
            self.stats.record_request_slots(n, slots)

    def _replay_plan(self, tokens: int) -> tuple:
        """``(key, static batch updater, fill)`` for live batches of ``tokens`` tokens."""
        padded, key = self.replay_target(tokens)
        statics = self._replay_statics
        if padded not in statics:
            view = self.buffers.view
            names = [name for name, _ in _PREFILL_SLOTS]
            fields: dict[str, Any] = {name: view(name, padded) for name in names}
            # Request fields None: replaced by each live batch's own.
            static = StaticForwardBatch(forward_mode=ForwardMode.EXTEND, req_pool_indices=None, seq_lens=None, **fields)  # type: ignore[arg-type]  # request fields: each live batch's own
            statics[padded] = StaticBatchUpdater(static, keep=set(names))
        names = [name for name, _ in _PREFILL_SLOTS]
        plan = (
            key,
            statics[padded],
            FusedFill(self.buffers, names, [tokens] * len(names), [padded] * len(names)),
        )
        if len(self._replay_plans) >= MAX_REPLAY_PLANS:  # bounded: token counts can be many
            self._replay_plans.clear()
        self._replay_plans[tokens] = plan
        return plan

    def graph_forward(self, batch: ForwardBatch) -> Any:
        return self.model.forward(batch)

    def finish_output(
        self, graph_output: Any, batch: ForwardBatch, static_batch: ForwardBatch, key: Optional[ShapeKey] = None
    ) -> Any:
        # hidden[:T] is a view into graph memory (through any supported structure; every
        # tensor leads with the padded tokens, checked at capture); compute_logits usually
        # makes a fresh tensor (owned_outputs copies it otherwise).
        tokens = batch.num_tokens
        hidden = self.live_rows(graph_output, key, static_batch.input_ids.shape[0], tokens, tokens)
        with forward_context(batch):
            return self.model.compute_logits(hidden, batch)

    def eager_forward(self, batch: ForwardBatch) -> Any:
        with forward_context(batch):
            return self.model.compute_logits(self.model.forward(batch), batch)

    def pad_batch(self, batch: ForwardBatch, padded: int) -> ForwardBatch:
        """``batch`` padded to ``padded`` tokens as :meth:`replay_prepare` pads it (new
        tensors): token 0 at position 0 into KV slot 0 past the live tokens; request
        fields the live ones (:mod:`.padded_eager`)."""
        from .padded_eager import pad_rows

        return batch.replace(
            input_ids=pad_rows(batch.input_ids, padded, 0),
            positions=pad_rows(batch.positions, padded, 0),
            out_cache_loc=pad_rows(batch.out_cache_loc, padded, 0),
        )
