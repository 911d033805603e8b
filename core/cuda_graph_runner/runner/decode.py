"""``DecodeCudaGraphRunner``: graphs keyed by batch size, for the fixed-width modes
(decode, target-verify, DLLM block extend), with optional graph variants per size
(:mod:`.variants`) and model-owned static inputs (:mod:`.static_inputs`)."""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import torch

from ..backend.base import ShapeKey
from ..backend.buffers import BATCH_AXIS, TOKEN_AXIS, FusedFill
from ..backend.context import forward_context
from ..backend.forward_batch import ForwardBatch, ForwardMode, StaticForwardBatch
from ..config import ConfigInput
from .base import MAX_REPLAY_PLANS, BaseCudaGraphRunner, get_batch_sizes_to_capture, pad_list
from .model_protocol import GraphModel
from .static_inputs import ModelStaticInputs, declared_static_inputs
from .variants import VariantSelector, compose_key_variant, model_variants, resolve_variants

#: Buffers copied from the live batch at every replay: (field, axis, dtype).
_DECODE_SLOTS = (
    ("input_ids", TOKEN_AXIS, torch.int64),
    ("positions", TOKEN_AXIS, torch.int64),
    ("out_cache_loc", TOKEN_AXIS, torch.int64),
    ("req_pool_indices", BATCH_AXIS, torch.int64),
    ("seq_lens", BATCH_AXIS, torch.int32),
)


def default_decode_batch_sizes(max_bs: int) -> List[int]:
    """sglang's decode buckets: 1, 2, 4, 8, 12, 16..256 step 8, 272..511 step 16,
    512.. step 32, cut at ``max_bs`` (the caller adds ``max_bs`` itself)."""
    sizes = [1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16)) + list(range(512, max_bs + 1, 32))
    return [s for s in sizes if s <= max_bs]


_MODES_ACCEPTED = (
    "ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DLLM_EXTEND, 'decode', 'target_verify' or 'dllm_extend'"
)


def as_decode_mode(mode: Any) -> ForwardMode:
    """``mode`` as a ``ForwardMode``: members pass, strings are matched by value or name,
    any case (``"decode"``, ``"TARGET_VERIFY"``, ``"dllm_extend"``).

    Raises:
        TypeError: neither a ``ForwardMode`` nor a string.
        ValueError: a string naming no mode (lists the accepted ones).
    """
    if isinstance(mode, ForwardMode):
        return mode
    if isinstance(mode, str):
        text = mode.strip().lower()
        for member in ForwardMode:
            if text in (member.value, member.name.lower()):
                return member
        raise ValueError(f"mode={mode!r} is not a forward mode; accepted: {_MODES_ACCEPTED}")
    raise TypeError(f"mode={mode!r} ({type(mode).__name__}) is not accepted; pass {_MODES_ACCEPTED}")


class DecodeCudaGraphRunner(BaseCudaGraphRunner):
    """Decode runner: one graph per batch size and variant, logits ``[num_tokens, vocab]`` float32 out.

    Args (beyond :class:`BaseCudaGraphRunner`'s):
        mode: ``ForwardMode.DECODE``, ``ForwardMode.TARGET_VERIFY`` or
            ``ForwardMode.DLLM_EXTEND``, or their values as strings (``"decode"``,
            ``"target_verify"``, ``"dllm_extend"``, any case).
        num_tokens_per_req: tokens per request (1 for decode, the draft width for
            target-verify, the block width for DLLM_EXTEND); the token axis holds
            ``batch_size * num_tokens_per_req`` rows.
        seq_len_fill_value: ``seq_lens`` of padded requests, on the device and in the
            static batch's ``seq_lens_cpu`` (raised to ``num_tokens_per_req`` so a padded
            request's queries always see at least one key). None: the model's
            ``get_cuda_graph_seq_len_fill_value()`` when it has one, else 1.

    Padded requests point at request row 0 and KV slot 0, the reserved dummies.

    Variants (:mod:`.variants`): with a model that declares ``graph_variants()`` (or a
    config ``variants`` key), every size is captured once per variant and each live batch
    replays the variant ``model.graph_variant(batch)`` picks; keys read
    ``"<mode>[:<width>]|<variant>"``. Model-owned static inputs (:mod:`.static_inputs`):
    what ``model.static_inputs()`` declares is allocated next to the runner's own slots,
    handed to the model in ``batch.extra`` and filled and padded from each live batch.

    Outputs: the logits of a replay live in graph memory and are valid until the next
    replay of any graph in the same pool, unless ``owned_outputs=True`` (see
    :class:`BaseCudaGraphRunner`).

    Raises:
        TypeError: ``mode`` is neither a ``ForwardMode`` nor a string.
        ValueError: ``mode`` names no decode-like mode; ``num_tokens_per_req`` does not
            fit it.
    """

    phase: ClassVar[str] = "decode"
    default_max_size: ClassVar[int] = 256

    def __init__(
        self,
        model: GraphModel,
        config: ConfigInput = None,
        *,
        mode: "ForwardMode | str" = ForwardMode.DECODE,
        num_tokens_per_req: int = 1,
        seq_len_fill_value: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        mode = as_decode_mode(mode)
        if not mode.is_decode_like():
            raise ValueError(f"DecodeCudaGraphRunner runs DECODE, TARGET_VERIFY or DLLM_EXTEND batches, not {mode}")
        if (
            isinstance(num_tokens_per_req, bool)
            or not isinstance(num_tokens_per_req, int)
            or num_tokens_per_req < 1
            or (mode is ForwardMode.DECODE and num_tokens_per_req != 1)
        ):
            raise ValueError(
                f"num_tokens_per_req={num_tokens_per_req!r} is invalid for {mode.name} "
                "(DECODE takes 1, TARGET_VERIFY and DLLM_EXTEND an int >= 1)"
            )
        self.mode = mode
        self.num_tokens_per_req = num_tokens_per_req
        if seq_len_fill_value is None:  # the model's attention says (sglang's fill value), else 1
            fill_hook = getattr(model, "get_cuda_graph_seq_len_fill_value", None)
            seq_len_fill_value = int(fill_hook()) if fill_hook is not None else 1
        self.seq_len_fill_value = max(seq_len_fill_value, num_tokens_per_req)
        self._mode_part = "decode" if mode is ForwardMode.DECODE else f"{mode.value}:{num_tokens_per_req}"
        #: The model's own static inputs (None for backend ``disabled``, which has no buffers).
        self.model_inputs: Optional[ModelStaticInputs] = None
        super().__init__(model, config, **kwargs)
        where = f"{type(self).__name__} ({self.mode.value})"
        #: Variant labels captured per size, in order (``[""]``: one graph per size).
        self.variants: List[str] = resolve_variants(getattr(self.phase_config, "variants", None), model, where)
        declared = model_variants(model) if self.variants != [""] else None
        self._select_variant = VariantSelector(model, declared, where)
        self._variant_keys: Dict[Tuple[int, str], ShapeKey] = {}

    # -- policy ------------------------------------------------------------------------
    def get_sizes_to_capture(self) -> List[int]:
        return get_batch_sizes_to_capture(self.phase_config, self.default_max_size, default_decode_batch_sizes)

    def slot_width(self, name: str) -> int:
        """Rows per request of the decode slot ``name``: ``num_tokens_per_req`` on the token
        axis, 1 on the batch axis. A subclass whose graph writes several KV slots per
        input token (a draft runner's k steps) widens ``out_cache_loc`` here."""
        axis = next(a for n, a, _ in _DECODE_SLOTS if n == name)
        return self.num_tokens_per_req if axis == TOKEN_AXIS else 1

    def init_buffers(self) -> None:
        for name, axis, dtype in _DECODE_SLOTS:
            rows = self.max_size * self.slot_width(name)
            pad = self.seq_len_fill_value if name == "seq_lens" else 0
            self.buffers.register(name, axis=axis, rows=rows, dtype=dtype, pad_value=pad)
        specs = declared_static_inputs(self.model, reserved=[name for name, _, _ in _DECODE_SLOTS])
        if specs:
            self.model_inputs = ModelStaticInputs(specs, self.buffers, self.max_size, self.num_tokens_per_req)

    def make_key(self, size: int, variant: str = "") -> ShapeKey:
        """``ShapeKey(size, "<mode>[:<width>][|<variant>]")`` (format: :mod:`.variants`)."""
        return ShapeKey(size, compose_key_variant(self._mode_part, variant))

    def make_variant_key(self, size: int, variant: str) -> ShapeKey:
        return self.make_key(size, variant)

    def capture_variants(self) -> Sequence[str]:
        return self.variants

    def variant_of(self, batch: ForwardBatch) -> str:
        """The variant a live ``batch`` replays (``model.graph_variant(batch)``, asked on
        every call; ``""`` without variants)."""
        return self._select_variant(batch)

    def variant_key(self, padded: int, variant: str) -> ShapeKey:
        """The key of captured size ``padded`` in ``variant``, made once per pair (``""``:
        the key ``replay_target`` made), so ``decide`` and ``replay_prepare`` share it."""
        if not variant:
            return self.plain_key(padded)
        key = self._variant_keys.get((padded, variant))
        if key is None:
            key = self._variant_keys[(padded, variant)] = self.same_key(self.make_key(padded, variant))
        return key

    def size_of(self, batch: ForwardBatch) -> int:
        return batch.batch_size

    def batch_matches(self, batch: ForwardBatch) -> bool:
        return batch.forward_mode is self.mode and batch.num_tokens_per_req == self.num_tokens_per_req

    def _static_batch(self, bs: int, seq_lens_cpu: Any = None) -> ForwardBatch:
        tokens = bs * self.num_tokens_per_req
        view = self.buffers.view
        return StaticForwardBatch(  # host fields guarded during capture (host_guard)
            forward_mode=self.mode,
            input_ids=view("input_ids", tokens),
            positions=view("positions", tokens),
            out_cache_loc=view("out_cache_loc", bs * self.slot_width("out_cache_loc")),
            req_pool_indices=view("req_pool_indices", bs),
            seq_lens=view("seq_lens", bs),
            seq_lens_cpu=seq_lens_cpu,
            num_tokens_per_req=self.num_tokens_per_req,
            extra=self.model_inputs.static_extra(None, bs) if self.model_inputs else {},
        )

    def capture_prepare(self, size: int) -> ForwardBatch:
        # The buffers hold pad values (dummy row 0, slot 0) outside replays.
        self.buffers.reset()
        return self._static_batch(size, [self.seq_len_fill_value] * size)

    def replay_prepare(self, batch: ForwardBatch) -> Tuple[ShapeKey, ForwardBatch]:
        """Copy ``batch`` into the static buffers padded to the captured batch size.

        Per step: one ``_foreach_copy_`` per dtype group, pad fills only for rows a larger
        batch left behind, and the one static batch of that size refreshed (its
        ``seq_lens_cpu``, padded, and ``extra``); the plan of each live size is built once
        (:class:`~cuda_graph_runner.backend.buffers.FusedFill`). The returned static batch is
        reused by later replays of the same size.

        Guarantee to the model's ``init_forward_metadata_replay(static)`` (a plan-based
        attention plans from it, never from device tensors): ``static.seq_lens_cpu`` is the
        live batch's host lengths padded to the captured batch size with
        ``seq_len_fill_value`` (None only when the live batch carries none).

        Raises:
            ValueError: more requests than the largest captured size, a tensor of the
                batch without the rows its axis needs, or of another dtype kind than its
                slot (float ``input_ids``: names the field and both dtypes).
        """
        raw_bs = batch.req_pool_indices.shape[0]
        plan = self._replay_plans.get(raw_bs)
        if plan is None:
            plan = self._replay_plan(raw_bs)
        static, fill, bs = plan
        decided = self._decided  # forward's decision for this very batch: the model is asked once
        variant = decided[1] if decided is not None and decided[0] is batch else self._select_variant(batch)
        key = self.variant_key(bs, variant)
        fill((batch.input_ids, batch.positions, batch.out_cache_loc, batch.req_pool_indices, batch.seq_lens))
        seq_lens_cpu = batch.seq_lens_cpu
        if seq_lens_cpu is not None and len(seq_lens_cpu) < bs:
            seq_lens_cpu = pad_list(seq_lens_cpu, bs, self.seq_len_fill_value)
        static.seq_lens_cpu = seq_lens_cpu
        static.graph_variant = variant
        model_inputs = self.model_inputs
        if model_inputs is None:
            static.extra = batch.extra
        else:
            model_inputs.fill(batch.extra, raw_bs, bs)
            static.extra = model_inputs.static_extra(batch.extra, bs)
        init = getattr(self.model, "init_forward_metadata_replay", None)
        if init is not None:
            init(static)
        return key, static

    def _replay_plan(self, raw_bs: int) -> tuple:
        """``(static batch, fill, padded bs)`` for live batches of ``raw_bs`` requests."""
        bs, _ = self.replay_target(raw_bs)
        statics = self._replay_statics
        if bs not in statics:
            statics[bs] = self._static_batch(bs)
        names = [name for name, _, _ in _DECODE_SLOTS]
        rows = [raw_bs * self.slot_width(name) for name in names]
        padded = [bs * self.slot_width(name) for name in names]
        plan = (statics[bs], FusedFill(self.buffers, names, rows, padded), bs)
        if len(self._replay_plans) >= MAX_REPLAY_PLANS:  # bounded: token counts can be many
            self._replay_plans.clear()
        self._replay_plans[raw_bs] = plan
        return plan

    def graph_forward(self, batch: ForwardBatch) -> Any:
        return self.model.compute_logits(self.model.forward(batch), batch)

    def output_rows(self, size: int) -> Tuple[int, Optional[int]]:
        return size * self.num_tokens_per_req, size

    def finish_output(
        self, graph_output: Any, batch: ForwardBatch, static_batch: ForwardBatch, key: Optional[ShapeKey] = None
    ) -> Any:
        # Per-token tensors [bs * w, ...] to the live tokens, per-request ones [bs, ...]
        # to the live requests (TARGET_VERIFY / DLLM_EXTEND may return both).
        bs = batch.req_pool_indices.shape[0]
        return self.live_rows(graph_output, key, static_batch.req_pool_indices.shape[0], batch.num_tokens, bs)

    def eager_forward(self, batch: ForwardBatch) -> Any:
        with forward_context(batch):
            return self.graph_forward(batch)

    def pad_batch(self, batch: ForwardBatch, padded: int) -> ForwardBatch:
        """``batch`` padded to ``padded`` requests as :meth:`replay_prepare` pads it (new
        tensors): padded requests on request row 0 and KV slot 0 with token 0 at position 0,
        ``seq_lens`` and ``seq_lens_cpu`` ``seq_len_fill_value``, the model's declared static
        inputs their ``pad_value`` (:mod:`.padded_eager`)."""
        from .padded_eager import pad_extra, pad_host, pad_rows

        tokens = padded * self.num_tokens_per_req
        specs = declared_static_inputs(self.model, reserved=[name for name, _, _ in _DECODE_SLOTS])
        return batch.replace(
            input_ids=pad_rows(batch.input_ids, tokens, 0),
            positions=pad_rows(batch.positions, tokens, 0),
            out_cache_loc=pad_rows(batch.out_cache_loc, padded * self.slot_width("out_cache_loc"), 0),
            req_pool_indices=pad_rows(batch.req_pool_indices, padded, 0),
            seq_lens=pad_rows(batch.seq_lens, padded, self.seq_len_fill_value),
            seq_lens_cpu=pad_host(batch.seq_lens_cpu, padded, self.seq_len_fill_value),
            extra=pad_extra(
                batch.extra, specs, batch.batch_size, padded, self.num_tokens_per_req, batch.input_ids.device
            )
            if specs
            else batch.extra,
        )
