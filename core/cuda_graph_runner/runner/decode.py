"""``DecodeCudaGraphRunner``: graphs keyed by batch size, for decode and target-verify."""

from __future__ import annotations

from typing import Any, ClassVar, List, Tuple

import torch

from ..backend import ShapeKey
from ..buffers import BATCH_AXIS, TOKEN_AXIS, FusedFill
from ..config import ConfigInput
from ..forward_batch import ForwardBatch, ForwardMode, StaticForwardBatch
from ..forward_context import forward_context
from ..model_protocol import GraphModel
from .base import MAX_REPLAY_PLANS, BaseCudaGraphRunner, get_batch_sizes_to_capture, pad_list, slice_rows

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


_MODES_ACCEPTED = "ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, 'decode' or 'target_verify'"


def as_decode_mode(mode: Any) -> ForwardMode:
    """``mode`` as a ``ForwardMode``: members pass, strings are matched by value or name,
    any case (``"decode"``, ``"TARGET_VERIFY"``).

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
    """Decode runner: one graph per batch size, logits ``[num_tokens, vocab]`` float32 out.

    Args (beyond :class:`BaseCudaGraphRunner`'s):
        mode: ``ForwardMode.DECODE`` or ``ForwardMode.TARGET_VERIFY``, or their values as
            strings (``"decode"``, ``"target_verify"``, any case).
        num_tokens_per_req: tokens per request (1 for decode, the draft width for
            target-verify); the token axis holds ``batch_size * num_tokens_per_req`` rows.
        seq_len_fill_value: ``seq_lens`` of padded requests (>= ``num_tokens_per_req``
            so a padded request's queries always see at least one key).

    Padded requests point at request row 0 and KV slot 0, the reserved dummies.

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
        seq_len_fill_value: int = 1,
        **kwargs: Any,
    ) -> None:
        mode = as_decode_mode(mode)
        if not mode.is_decode_like():
            raise ValueError(f"DecodeCudaGraphRunner runs DECODE or TARGET_VERIFY batches, not {mode}")
        if num_tokens_per_req < 1 or (mode is ForwardMode.DECODE and num_tokens_per_req != 1):
            raise ValueError(
                f"num_tokens_per_req={num_tokens_per_req} is invalid for {mode.name} (DECODE takes 1, TARGET_VERIFY >= 1)"
            )
        self.mode = mode
        self.num_tokens_per_req = num_tokens_per_req
        self.seq_len_fill_value = max(seq_len_fill_value, num_tokens_per_req)
        super().__init__(model, config, **kwargs)

    # -- policy ------------------------------------------------------------------------
    def get_sizes_to_capture(self) -> List[int]:
        return get_batch_sizes_to_capture(self.phase_config, self.default_max_size, default_decode_batch_sizes)

    def init_buffers(self) -> None:
        width = self.num_tokens_per_req
        for name, axis, dtype in _DECODE_SLOTS:
            rows = self.max_size * (width if axis == TOKEN_AXIS else 1)
            pad = self.seq_len_fill_value if name == "seq_lens" else 0
            self.buffers.register(name, axis=axis, rows=rows, dtype=dtype, pad_value=pad)

    def make_key(self, size: int) -> ShapeKey:
        if self.mode is ForwardMode.DECODE:
            return ShapeKey(size, "decode")
        return ShapeKey(size, f"target_verify:{self.num_tokens_per_req}")

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
            out_cache_loc=view("out_cache_loc", tokens),
            req_pool_indices=view("req_pool_indices", bs),
            seq_lens=view("seq_lens", bs),
            seq_lens_cpu=seq_lens_cpu,
            num_tokens_per_req=self.num_tokens_per_req,
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
        (:class:`~cuda_graph_runner.buffers.FusedFill`). The returned static batch is
        reused by later replays of the same size.

        Raises:
            ValueError: more requests than the largest captured size, or a tensor of the
                batch without the rows its axis needs.
        """
        raw_bs = batch.req_pool_indices.shape[0]
        plan = self._replay_plans.get(raw_bs)
        if plan is None:
            plan = self._replay_plan(raw_bs)
        key, static, fill, bs = plan
        fill((batch.input_ids, batch.positions, batch.out_cache_loc, batch.req_pool_indices, batch.seq_lens))
        seq_lens_cpu = batch.seq_lens_cpu
        if seq_lens_cpu is not None and len(seq_lens_cpu) < bs:
            seq_lens_cpu = pad_list(seq_lens_cpu, bs, self.seq_len_fill_value)
        static.seq_lens_cpu = seq_lens_cpu
        static.extra = batch.extra
        init = getattr(self.model, "init_forward_metadata_replay", None)
        if init is not None:
            init(static)
        return key, static

    def _replay_plan(self, raw_bs: int) -> tuple:
        """``(key, static batch, fill, padded bs)`` for live batches of ``raw_bs`` requests."""
        bs, key = self.replay_target(raw_bs)
        width = self.num_tokens_per_req
        statics = self._replay_statics
        if bs not in statics:
            statics[bs] = self._static_batch(bs)
        names = [name for name, _, _ in _DECODE_SLOTS]
        rows = [raw_bs * width if axis == TOKEN_AXIS else raw_bs for _, axis, _ in _DECODE_SLOTS]
        padded = [bs * width if axis == TOKEN_AXIS else bs for _, axis, _ in _DECODE_SLOTS]
        plan = (key, statics[bs], FusedFill(self.buffers, names, rows, padded), bs)
        if len(self._replay_plans) >= MAX_REPLAY_PLANS:  # bounded: token counts can be many
            self._replay_plans.clear()
        self._replay_plans[raw_bs] = plan
        return plan

    def graph_forward(self, batch: ForwardBatch) -> Any:
        return self.model.compute_logits(self.model.forward(batch), batch)

    def finish_output(self, graph_output: Any, batch: ForwardBatch, static_batch: ForwardBatch) -> Any:
        return slice_rows(graph_output, batch.num_tokens)

    def eager_forward(self, batch: ForwardBatch) -> Any:
        with forward_context(batch):
            return self.graph_forward(batch)
