"""One step of a runner under data-parallel attention (:mod:`cuda_graph_runner.runner.dp_group`).

:func:`dp_forward` is what ``runner.forward(batch)`` runs when the model holds a
:class:`~cuda_graph_runner.runner.dp_group.DPGroup`: the step's agreement (one host
all-reduce), the rank's batch padded to the largest live size over the group (a dummy
batch of that size on a rank without requests), the same replay-or-eager decision and
graph key on every rank, and the rank's own live rows of the output.

Padding rows are the runners' own (``runner.pad_batch``, as ``replay_prepare`` pads):
decode requests on the reserved request row 0 and KV slot 0 with ``seq_len_fill_value``;
prefill tokens (token 0, position 0, slot 0) past the live requests, belonging to no
request. A replay then pads the step's size up to its captured bucket as for any batch;
the eager path is ``runner.eager`` (``padded_eager`` applies).
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from ..backend.forward_batch import ForwardBatch, ForwardMode
from ..backend.profiling import eager_range_name, profiler_enabled
from .dp_group import DataParallelStepError, DPGroup
from .sleep import asleep_error
from .stats import REASON_EMPTY, REASON_OTHER_RANK

__all__ = ["dp_forward", "padded_batch"]


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:500]}"


def dp_forward(runner: Any, dp: DPGroup, batch: Optional[ForwardBatch]) -> Any:
    """Run one data-parallel step of ``runner`` (call it on every rank, every step).

    Args:
        runner: a decode or prefill runner whose model's ``dp_group`` is ``dp``.
        batch: this rank's live batch, or None when it has no requests this step.

    Returns:
        The output of this rank's live rows only (decode logits ``[bs * width, vocab]``;
        prefill logits ``[requests, vocab]``; zero rows for a rank without requests), or
        None when no rank of the group has requests (nothing runs).

    Raises:
        DataParallelStepError: the step's decision failed on another rank (named).
        DataParallelMismatchError: ranks would replay different graph variants.
        ValueError: (this rank's own, the other ranks get DataParallelStepError) a live
            batch the replay would refuse (:func:`check_live_batch`), or a model with
            model-owned static inputs.
        cuda_graph_runner.runner.weights.StaleWeightsError: (this rank's own, as the ValueError)
            the phase config's ``check_weights_every`` check found moved weights.
        cuda_graph_runner.runner.sleep.RunnerAsleepError: (this rank's own, as the
            ValueError) the runner is asleep and ``forward_asleep`` is ``raise``.
        Whatever else this rank's own decision raised (after the other ranks were told).
    """
    live = 0
    variant: Optional[str] = None
    ready = bool(runner.captured_keys) and not runner.is_disabled
    try:
        if runner.phase == "decode" and runner.model_inputs is not None:
            raise ValueError(
                "data parallelism does not pad model-owned static inputs (model.static_inputs() declares some, "
                "LoRA adapter ids say): run the data-parallel model without them"
            )
        if batch is not None:
            live = runner.size_of(batch)
            check_live_batch(runner, batch)
            if ready:  # what decide() refuses on this rank alone must not reach the replay
                ready = runner.batch_matches(batch) and runner.fits_graphs(batch)
            if ready:
                variant = runner.variant_of(batch)
                # Asked for the largest graph of the variant (every rank holds it): the
                # backend's per-batch conditions, before the size is known.
                ready = bool(runner.backend.can_run(batch, runner.variant_key(runner.max_size, variant)))
                if not ready:
                    variant = None
        # As forward() without a group: a rank whose weights moved under its graphs, or
        # that is asleep and raises, stops every rank at this step's agreement.
        if ready and runner._weights_every:
            runner._weights_tick()
        if runner.sleep_state is not None and runner._asleep_raises:
            raise asleep_error(runner)
    except Exception as exc:
        with contextlib.suppress(DataParallelStepError):
            dp.agree_batch(live, False, None, variants=runner.capture_variants(), failed=_one_line(exc))
        raise
    size, all_ready, agreed = dp.agree_batch(live, ready, variant, variants=runner.capture_variants())
    if size == 0:
        return None
    key = _agreed_key(runner, size, all_ready, agreed)
    work = padded_batch(runner, batch, size)
    if key is not None:
        runner.stats.record_replay(size)
        runner._decided = (work, agreed or "")  # replay_prepare reads the agreed variant
        try:
            output = runner.replay(work)
        finally:
            runner._decided = None
    else:
        if batch is None:
            reason = REASON_EMPTY
        elif ready and live <= runner.max_size:
            reason = REASON_OTHER_RANK
        else:  # this rank's own reason: the decision on the step's padded batch
            reason = runner._eager_reason(runner.decide(work))
        runner.stats.record_fallback(reason)
        if profiler_enabled():  # the eager step is named in a trace, as a replay is
            with torch.profiler.record_function(eager_range_name(runner.phase, reason)):
                output = runner.eager(work)
        else:
            output = runner.eager(work)
    return own_rows(runner, output, batch, size)


def check_live_batch(runner: Any, batch: ForwardBatch) -> None:
    """Refuse, before the step's agreement, what the replay would refuse after it on this
    rank alone (the ranks' batches differ, so the others would be left in the model's
    collectives): token fields without the rows their axis needs, a float token field,
    an ``extra`` key the captured forward looked up and did not find, a prefill batch
    without ``extend_seq_lens`` for graphs with request slots.

    Raises:
        ValueError: a field's rows or dtype (names the field, its shape or dtype, and
            what is accepted); ``extend_seq_lens`` missing (request slots).
        cuda_graph_runner.backend.errors.CudaGraphHostValueError: the ``extra`` key (named).
    """
    from ..backend.host_guard import missing_extra_error

    for name in ("input_ids", "positions", "out_cache_loc"):
        # Decode rows per request are the runner's slot width (a draft runner's
        # out_cache_loc holds one KV slot per step); prefill's are the batch's tokens.
        rows = batch.batch_size * runner.slot_width(name) if runner.phase == "decode" else batch.num_tokens
        t = getattr(batch, name)
        if t.shape[:1] != (rows,) or t.dtype.is_floating_point or t.dtype.is_complex:
            raise ValueError(
                f"batch.{name} is {tuple(t.shape)} {t.dtype}; accepted: [{rows}] of an integer dtype "
                f"({runner.phase} batch of {batch.batch_size} requests)"
            )
    if getattr(runner, "request_slots", None) is not None and batch.extend_seq_lens is None:
        raise ValueError(
            "batch.extend_seq_lens is None; accepted: [requests] int32 new tokens per request "
            "(prefill graphs with request slots pad the request axis from it)"
        )
    for name in runner._missing_extra:
        if name in batch.extra:
            raise missing_extra_error(name, runner._backend_label(), runner.phase)


def _agreed_key(runner: Any, size: int, all_ready: bool, variant: Optional[str]) -> Any:
    """The graph every rank replays for a step of ``size`` rows, or None (every rank runs
    eagerly). A function of agreed values and of the captured graphs only, which the
    ranks share (capture agreed on them), so it is the same on every rank."""
    if not all_ready or variant is None or size > runner.max_size:
        return None
    padded, _ = runner.replay_target(size)
    if runner.phase == "prefill":
        from .prefill import MAX_PADDING_RATIO  # the prefill runner's own rule, on the agreed size

        if padded > MAX_PADDING_RATIO * size:
            return None
    key = runner.variant_key(padded, variant)
    return key if key in runner.captured_keys else None


def padded_batch(runner: Any, batch: Optional[ForwardBatch], size: int) -> ForwardBatch:
    """``batch`` with padding rows up to ``size`` along the runner's axis (decode:
    requests, prefill: tokens) as a replay pads it (``runner.pad_batch``), or a dummy
    batch of ``size`` (an empty batch so padded) when ``batch`` is None; ``batch``
    itself when it already has ``size``."""
    if batch is None:
        batch = _empty_batch(runner)
    elif runner.size_of(batch) == size:
        return batch
    return runner.pad_batch(batch, size)


def _empty_batch(runner: Any) -> ForwardBatch:
    """A batch of no request and no token in the runner's mode, on its device."""
    device = runner.device
    i64, i32 = torch.zeros(0, dtype=torch.int64, device=device), torch.zeros(0, dtype=torch.int32, device=device)
    if runner.phase == "prefill":
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            input_ids=i64,
            positions=i64,
            out_cache_loc=i64,
            req_pool_indices=i64,
            seq_lens=i32,
            extend_seq_lens=i32,
            extend_prefix_lens=i32,
            seq_lens_cpu=[],
            extend_seq_lens_cpu=[],
            extend_prefix_lens_cpu=[],
        )
    return ForwardBatch(
        forward_mode=runner.mode,
        input_ids=i64,
        positions=i64,
        out_cache_loc=i64,
        req_pool_indices=i64,
        seq_lens=i32,
        seq_lens_cpu=[],
        num_tokens_per_req=runner.num_tokens_per_req,
    )


def own_rows(runner: Any, output: Any, batch: Optional[ForwardBatch], size: int) -> Any:
    """``output`` of a step padded to ``size`` requests cut to ``batch``'s own rows (the
    decode runner's per-token and per-request tensors; zero rows for ``batch`` None).
    Prefill outputs are per request already: its padding is tokens of no request."""
    if runner.phase != "decode":
        return output
    bs = 0 if batch is None else batch.batch_size
    if bs == size:
        return output
    return runner.live_rows(output, None, size, bs * runner.num_tokens_per_req, bs)
